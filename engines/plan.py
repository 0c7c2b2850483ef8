"""The plan: which engines a requested precision may end up as, in the order they are tried.

    steps = plan_steps("best", api)   # [int8, int8 (folded), fp16, fp32] on TensorRT-RTX
    steps = plan_steps("fp16", api)   # [fp16, fp32]

Precision names and parsing: engines.precision. A plan is tried top-down by the agent's precision job:
each step's graph passes the accuracy gate, is built, and (where the engine executes) is gated again; a
step that fails any of these gives way to the next one. The policy depends only on what the TensorRT
flavour can do (engines.trt probes):
- weakly typed TensorRT (<= 10): INT8 through a calibrator on the calibration frames;
- strongly typed TensorRT (11, RTX): INT8 from a Q/DQ ONNX; when TensorRT cannot build the unfolded Q/DQ
  graph (TensorRT-RTX 1.7 on tf2onnx graphs), the folded graph is tried before dropping to FP16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engines.precision import ORDER, Built, Precision


class Capabilities(Protocol):
    """What a plan needs to know of a TensorRT flavour (engines.trt.TrtApi has it)."""

    @property
    def strongly_typed(self) -> bool: ...

    def precisions(self) -> list[str]: ...


@dataclass(frozen=True)
class Step:
    precision: Built
    folded: bool = False  # INT8 from the folded Q/DQ graph
    only_if_build_failed: bool = False  # tried only when the step before it failed to build
    calibrator: bool = False  # INT8 through TensorRT's calibrator (weakly typed) instead of Q/DQ

    @property
    def label(self) -> str:
        return f"{self.precision}{' (folded)' if self.folded else ''}"


def candidates(requested: Precision) -> tuple[Built, ...]:
    """The precisions `requested` may end up as, most reduced first (best and int8 start at int8)."""
    start: Built = "int8" if requested == "best" else requested
    return ORDER[ORDER.index(start) :]


def plan_steps(requested: Precision, caps: Capabilities) -> list[Step]:
    """The steps for `requested` on this TensorRT flavour, in the order they are tried."""
    available = set(caps.precisions())
    steps: list[Step] = []
    for precision in candidates(requested):
        if precision not in available and precision != "fp32":
            continue
        if precision == "int8" and not caps.strongly_typed:
            steps.append(Step("int8", calibrator=True))
        elif precision == "int8":
            steps += [Step("int8"), Step("int8", folded=True, only_if_build_failed=True)]
        else:
            steps.append(Step(precision))
    return steps


def needs_calibration_frames(steps: list[Step]) -> bool:
    """INT8 needs calibration frames; every other reduced precision only held-out gate frames."""
    return any(s.precision == "int8" for s in steps)


def needs_gate(steps: list[Step]) -> bool:
    return any(s.precision != "fp32" for s in steps)
