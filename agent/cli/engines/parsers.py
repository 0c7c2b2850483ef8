"""The parsers of `edge-agent build` and `edge-agent engines list | show | rollback | prune`."""

from __future__ import annotations

from typing import Any

from agent.cli.argtypes import LOG_LEVELS, whole
from agent.cli.engines.actions import cmd_list, cmd_prune, cmd_rollback, cmd_show
from agent.cli.engines.build import cmd_build
from agent.cli.engines.store import DEFAULT_DIR, add_store_args, add_wait
from agent.config import EngineConfig, ModelConfig
from pipelines.models.registry import formats

# The daemon's defaults (models.M.streams, models.M.engine.workspace_mb): a build here gets a config's key.
DEFAULT_STREAMS: int = ModelConfig.model_fields["streams"].default
DEFAULT_WORKSPACE_MB: int = EngineConfig.model_fields["workspace_mb"].default
PRECISIONS = ("fp32", "fp16", "int8", "best")


def add_parsers(sub: Any) -> None:
    """Register `build` and `engines` on the CLI's subparsers."""
    _add_build(sub)
    _add_engines(sub)


def _add_build(sub: Any) -> None:
    b = sub.add_parser(
        "build",
        help="build an engine from an ONNX file, no agent.yaml needed (trtexec-like), into an engine store",
        description="Build a TensorRT / TensorRT-RTX engine from ONNX into {out}/{model}/ with the daemon's "
        "manifest and layout (the daemon's defaults for what is not given). No accuracy gate: best keeps "
        "the first of int8 -> fp16 -> fp32 that builds.",
    )
    b.add_argument("--onnx", required=True, metavar="M", help="the ONNX model")
    b.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    b.add_argument(
        "--shapes",
        metavar="SPEC",
        help="input shapes: NAME:1x3x416x416 (static) or NAME:MIN/OPT/MAX, comma-separated per input "
        "(default: from the ONNX, batch 1)",
    )
    b.add_argument(
        "--calib",
        metavar="DIR",
        help="calibration data for int8: .npy tensors (preprocessed NCHW float32) or images (with --format)",
    )
    b.add_argument("--calib-method", choices=["entropy", "minmax", "percentile"], default="minmax")
    b.add_argument("--format", choices=formats(), help="preprocess --calib images as")
    b.add_argument(
        "--out", default=str(DEFAULT_DIR), metavar="DIR", help=f"engine store (default ./{DEFAULT_DIR})"
    )
    b.add_argument("--backend", choices=["tensorrt", "tensorrt_rtx"], help="default: whichever is installed")
    b.add_argument("--name", help="model directory in the store (default: the ONNX file's stem)")
    b.add_argument(
        "--streams",
        type=whole(1, 16),
        default=DEFAULT_STREAMS,
        help=f"execution contexts the engine serves (models.M.streams; default {DEFAULT_STREAMS})",
    )
    b.add_argument(
        "--workspace-mb",
        type=whole(1, 1 << 20),
        default=DEFAULT_WORKSPACE_MB,
        help=f"builder workspace ({DEFAULT_WORKSPACE_MB})",
    )
    b.add_argument(
        "--target-cc", metavar="X.Y", help="TensorRT-RTX ahead-of-time target where no GPU is visible"
    )
    b.add_argument("--force", action="store_true", help="build even if the stored engine fits")
    add_wait(b)
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    b.set_defaults(func=cmd_build)


def _add_engines(sub: Any) -> None:
    e = sub.add_parser(
        "engines", help="the engines in a store: list, show a manifest, roll back to the previous plan, prune"
    )
    e_sub = e.add_subparsers(dest="engines_command", required=True)
    ls = e_sub.add_parser(
        "list", help="every model/key: current and previous plans, precision, TensorRT, GPU"
    )
    add_store_args(ls)
    ls.add_argument("--model", help="only this model")
    ls.add_argument("--json", action="store_true", help="a JSON array, one object per plan")
    ls.set_defaults(func=cmd_list)

    sh = e_sub.add_parser("show", help="one engine's manifest (default: the model's newest key)")
    add_store_args(sh)
    sh.add_argument("model")
    sh.add_argument("key", nargs="?")
    sh.add_argument("--previous", action="store_true", help="the key's previous plan instead of the current")
    sh.add_argument("--json", action="store_true", help="print the manifest as stored")
    sh.set_defaults(func=cmd_show)

    rb = e_sub.add_parser(
        "rollback", help="make the previous plan of a key current again (again: roll forward)"
    )
    add_store_args(rb)
    rb.add_argument("model")
    rb.add_argument("key", nargs="?", help="default: the model's newest key")
    add_wait(rb)
    rb.set_defaults(func=cmd_rollback)

    pr = e_sub.add_parser("prune", help="delete previous plans and what killed builds left (temp files)")
    add_store_args(pr)
    pr.add_argument("--model", help="only this model")
    pr.add_argument("--key", help="only this key's previous plan (needs --model)")
    pr.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    add_wait(pr)
    pr.set_defaults(func=cmd_prune)
