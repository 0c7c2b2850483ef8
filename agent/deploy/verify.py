"""A downloaded model checked before it is installed: the ONNX loads and passes onnx.checker, it fits the
format's adapter as the agent will serve it (one real inference on ONNX Runtime, as preflight does: exported
detectors often leave output shapes dynamic, so only a run shows their layout), and the labels file is one
UTF-8 label per line whose count the model's outputs agree with.

    model = verify_model(staged / "m.onnx", staged / "labels.txt", "nanodet")
    model.input_hw, model.num_classes, model.postprocess          # what the orchestrator builds and serves

Every refusal is a VerifyError naming the artifact (`artifacts.onnx`, `artifacts.labels`) and the file; a
garbage file is a clear reason, never a traceback. The checks are the project's own: pipelines.models'
resolve_onnx (input, graft record) and check_outputs (the adapter decodes the outputs), and
pipelines.postprocess.load_labels (how the agent reads labels when it serves).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.deploy.errors import VerifyError
from engines.runtimes.base import TensorSpec
from pipelines.models import SpecError, check_outputs, probe_outputs, resolve_onnx
from pipelines.models.registry import adapter_class, make_adapter
from pipelines.postprocess import load_labels

MAX_ONNX_BYTES = 2 << 30  # protobuf's own limit for one message; larger models need external data
MAX_LABELS_BYTES = 1 << 20
MAX_LABELS = 100_000
MAX_LABEL_CHARS = 256
ONNX_FIELD, LABELS_FIELD = "artifacts.onnx", "artifacts.labels"


@dataclass(frozen=True)
class VerifiedModel:
    """What the orchestrator needs of a checked model (its ModelSpec, minus the paths it will move)."""

    format: str
    input_name: str
    input_shape: tuple[int | None, ...]  # NCHW, None for a dynamic dim
    input_hw: tuple[int, int]  # the adapter's letterbox size (a dynamic side: the registry's default)
    labels: tuple[str, ...]
    postprocess: str  # "host", or "graph" for an ONNX with decode + NMS grafted on
    outputs: dict[str, tuple[int, ...]]  # output shapes of one run on a zero image

    @property
    def num_classes(self) -> int:
        return len(self.labels)


def verify_model(
    onnx_path: Path, labels_path: Path, fmt: str, expect_classes: int | None = None
) -> VerifiedModel:
    """The model at `onnx_path` with the labels at `labels_path` checked as format `fmt` would serve them;
    `expect_classes` (e.g. the serving model's) must equal the label count when given."""
    try:
        adapter_class(fmt)
    except ValueError as exc:
        raise VerifyError(str(exc), "format") from None
    labels = read_labels(labels_path)
    if expect_classes is not None and len(labels) != expect_classes:
        raise VerifyError(
            f"labels: {labels_path} has {len(labels)} labels, {expect_classes} classes were expected",
            LABELS_FIELD,
        )
    check_onnx(onnx_path)
    try:
        spec = resolve_onnx("candidate", onnx_path, fmt, labels)
        adapter = spec.adapter()
    except SpecError as exc:
        where = {"labels": LABELS_FIELD, "format": "format"}.get(exc.key, ONNX_FIELD)
        raise VerifyError(f"{where.rsplit('.', 1)[-1]}: {exc}", where) from None
    except ValueError as exc:  # make_adapter: not a 4-D image input
        raise VerifyError(f"onnx: {onnx_path}: {exc}", ONNX_FIELD) from None
    outputs = _probe(onnx_path)
    try:
        check_outputs(fmt, adapter, outputs)
    except ValueError as exc:
        others = _class_counts(fmt, spec.input, outputs, len(labels))
        if others:
            counts = " or ".join(str(n) for n in others)
            raise VerifyError(
                f"labels: {labels_path} has {len(labels)} labels, but {onnx_path.name}'s outputs fit {fmt} "
                f"only with {counts} classes ({exc})",
                LABELS_FIELD,
            ) from None
        raise VerifyError(f"onnx: {onnx_path}: {exc}", ONNX_FIELD) from None
    return VerifiedModel(
        format=fmt.lower(),
        input_name=spec.input.name,
        input_shape=tuple(spec.input.shape),
        input_hw=adapter.input_hw,
        labels=tuple(labels),
        postprocess=spec.postprocess,
        outputs={name: tuple(a.shape) for name, a in outputs.items()},
    )


def read_labels(path: Path) -> list[str]:
    """The labels as the agent reads them when it serves (load_labels: one per line, blank lines skipped),
    after bounds: size, no NUL or control characters (a binary file), label length and count."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_LABELS_BYTES + 1)
    except OSError as exc:
        raise VerifyError(f"labels: cannot read {path}: {exc.strerror or exc}", LABELS_FIELD) from None
    if len(raw) > MAX_LABELS_BYTES:
        raise VerifyError(f"labels: {path} is larger than {MAX_LABELS_BYTES} bytes", LABELS_FIELD)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VerifyError(f"labels: {path} is not UTF-8 text (byte {exc.start})", LABELS_FIELD) from None
    bad = next((i for i, c in enumerate(text) if not c.isprintable() and c not in "\r\n\t"), None)
    if bad is not None:
        line = text.count("\n", 0, bad) + 1
        raise VerifyError(
            f"labels: {path} line {line} holds a control character {text[bad]!r}: not a text file",
            LABELS_FIELD,
        )
    try:
        labels = load_labels(path)
    except (FileNotFoundError, ValueError) as exc:
        raise VerifyError(f"labels: {exc}", LABELS_FIELD) from None
    if len(labels) > MAX_LABELS:
        raise VerifyError(f"labels: {path} has {len(labels)} labels, at most {MAX_LABELS}", LABELS_FIELD)
    long = next((i for i, label in enumerate(labels) if len(label) > MAX_LABEL_CHARS), None)
    if long is not None:
        raise VerifyError(
            f"labels: {path}: label {long + 1} is longer than {MAX_LABEL_CHARS} characters", LABELS_FIELD
        )
    return labels


def check_onnx(path: Path) -> None:
    """The file is one bounded ONNX model that onnx.checker accepts, its weights inside it."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise VerifyError(f"onnx: cannot read {path}: {exc.strerror or exc}", ONNX_FIELD) from None
    if size > MAX_ONNX_BYTES:
        raise VerifyError(f"onnx: {path} is {size} bytes, more than one ONNX file holds (2 GiB)", ONNX_FIELD)
    import onnx  # here: serving needs no onnx, and loading it costs

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise VerifyError(f"onnx: {path} is not a valid ONNX model ({_short(exc)})", ONNX_FIELD) from None
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise VerifyError(
            f"onnx: {path} keeps weights in external files ({external[0]}, ...): deploy one self-contained "
            "ONNX file",
            ONNX_FIELD,
        )
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx's ValidationError and friends
        raise VerifyError(f"onnx: {path} is not a valid ONNX model ({_short(exc)})", ONNX_FIELD) from None


def _probe(path: Path) -> dict[str, np.ndarray]:
    """The outputs of one run on a zero image (ONNX Runtime on the CPU, one thread)."""
    try:
        return probe_outputs(path)
    except Exception as exc:  # ONNX Runtime raises its own types for a model it cannot run
        raise VerifyError(f"onnx: {path} does not run on ONNX Runtime ({_short(exc)})", ONNX_FIELD) from None


def _class_counts(fmt: str, input_spec: TensorSpec, outputs: dict[str, np.ndarray], count: int) -> list[int]:
    """Other class counts the outputs decode with (then the labels may be what is wrong; the shapes alone
    cannot always tell: a NanoDet's box maps look like score maps of 4 x bins classes)."""
    widths = {d for a in outputs.values() for d in a.shape[1:]}
    found = []
    for n in sorted(widths | {w - 4 for w in widths} | {w - 5 for w in widths}):
        if n <= 0 or n == count or n > MAX_LABELS:
            continue
        try:
            check_outputs(fmt, make_adapter(fmt, input_spec, n), outputs)
        except ValueError:
            continue
        found.append(n)
    return found


def _short(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"
