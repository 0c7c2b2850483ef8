"""What the config names must exist and fit, checked before anything starts (`run`, `--check-config`, reload).

The schema (agent.config) checks types and ranges; this checks the files and their contents: the ONNX
model (readable, an ONNX graph whose outputs the configured `format` decodes), the labels (UTF-8, not
empty), camera classes and zone/line labels against those labels. Every problem is one line
`FILE: key.path: message`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.config import AgentConfig, ModelConfig
from engines.runtimes.base import TensorSpec
from pipelines.models import check_outputs, make_adapter, probe_input
from pipelines.postprocess import load_labels


def _probe(path: Path) -> tuple[TensorSpec, dict[str, np.ndarray]]:
    """The model's input and its outputs for one zero image, run on ONNX Runtime (CPU): exported detectors
    often leave output shapes dynamic, so only a real inference shows their layout."""
    from engines.runtimes.ort import OrtBackend

    backend = OrtBackend(str(path), intra_threads=1)
    backend.load()
    try:
        spec = backend.input_spec
        return spec, backend.infer(probe_input(spec))
    finally:
        backend.close()


def check_model(name: str, m: ModelConfig, source: str) -> tuple[list[str], list[str] | None]:
    """(errors, labels) of one model section."""
    key = f"{source}: models.{name}"
    errors: list[str] = []
    labels: list[str] | None = None
    if m.labels is None:
        errors.append(f"{key}.labels: required (the class names, one per line, in output order)")
    else:
        try:
            labels = load_labels(m.labels)
        except (OSError, ValueError) as exc:
            errors.append(f"{key}.labels: {exc}")
    if not m.onnx.is_file():
        errors.append(f"{key}.onnx: {m.onnx}: no such file")
        return errors, labels
    try:
        inp, outputs = _probe(m.onnx)
    except Exception as exc:  # ONNX Runtime raises many types for a file that is not a model
        errors.append(f"{key}.onnx: {m.onnx}: not a readable ONNX model ({type(exc).__name__}: {exc})"[:300])
        return errors, labels
    if labels:
        try:
            adapter = make_adapter(m.format, inp, len(labels))
            check_outputs(m.format, adapter, outputs)
        except ValueError as exc:
            errors.append(f"{key}.format: {m.format}: {exc}")
    return errors, labels


def preflight(cfg: AgentConfig, source: str) -> list[str]:
    errors: list[str] = []
    labels: dict[str, list[str] | None] = {}
    for name, m in cfg.models.items():
        model_errors, labels[name] = check_model(name, m, source)
        errors += model_errors
    for cam_name, cam in cfg.cameras.items():
        known = labels.get(cam.model)
        if cam.classes and known:
            unknown = [c for c in cam.classes if c not in known]
            if unknown:
                errors.append(
                    f"{source}: cameras.{cam_name}.classes: unknown class {unknown[0]!r} "
                    f"(labels: {cfg.models[cam.model].labels})"
                )
        regions = {"zones": cam.zones, "lines": cam.lines}
        for what, items in regions.items():
            for region, rc in items.items():
                unknown = [c for c in rc.labels or () if known and c not in known]
                if unknown:
                    errors.append(
                        f"{source}: cameras.{cam_name}.{what}.{region}.labels: unknown label {unknown[0]!r} "
                        f"(labels: {cfg.models[cam.model].labels})"
                    )
    return errors
