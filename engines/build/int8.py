"""The INT8 part of configuring a TensorRT build (called by engines.build.trt_plan.build_plan).

    req = Int8Request(method="entropy", samples=500, cache=CalibrationCache(...), batches=..., ...)
    calibrator = configure_int8(api, network, config, profiles, prepared, spec, req)
    ... build ...; finish_int8(calibrator, req)   # raises BuildError if calibration failed or never ran

Weakly typed + calibrate: INT8 + FP16 flags, a calibrator (entropy/minmax/percentile) fed by a BatchFeeder,
calibration at profile 0's kOPT shape, and the selected layers constrained to FP16/FP32 (the builder sets
the one PREFER/OBEY precision-constraint flag). Weakly typed + Q/DQ: INT8 + FP16 flags only. Strongly
typed + Q/DQ: nothing to configure (the graph carries its precision).

Calibration must provably happen: TensorRT 7.1-8.0 skip it silently on networks with BOOL tensors or loops
(a grafted NMS tail has both) and build an "INT8" engine without a single INT8 layer. So finish_int8 fails
the build unless TensorRT fed at least one batch or read a calibration cache; and a graph with an FP32
island is calibrated without it first (engines.build.trt_plan), the full build reading that cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engines.build import islands
from engines.build.calibrator import (
    DEFAULT_QUANTILE,
    BatchFeeder,
    BatchSource,
    CalibrationCache,
    make_calibrator,
)
from engines.build.compat import BuildSpec
from engines.build.layer_precision import select_layers
from engines.cuda.buffers import Allocator
from engines.errors import BuildError, UnavailableError
from engines.precision import PreparedModel
from engines.settings import DEFAULT_INT8_KEEP_LAYERS, profiles_from_json
from engines.trt import TrtApi

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    from engines.build.calibrator import Calibrator

log = logging.getLogger("engines.int8")


@dataclass
class Int8Request:
    """What a calibrated INT8 build needs beyond the spec; results come back in the last fields."""

    method: str
    samples: int
    cache: CalibrationCache
    batches: BatchSource | None = None
    allocator: Allocator | None = None  # None: cuda-python (imported only if batches are really fed)
    quantile: float = DEFAULT_QUANTILE
    keep_layers: tuple[str, ...] = DEFAULT_INT8_KEEP_LAYERS
    keep_precision: str = "fp16"
    constraints: str = "prefer"
    # results
    flags: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # layer name -> selector/pattern
    cache_sha256: str | None = None
    batches_fed: int = 0
    cache_read: bool = False  # TensorRT took its scales from the calibration cache
    calibrated_graph: str = "whole"  # or "without_fp32_island" (engines.build.islands)
    needs_constraints: bool = False  # layers were kept out of INT8: the builder sets the constraint flag

    def record(self) -> dict[str, object]:
        """The manifest's build.int8 (the builder adds int8_layers)."""
        return {
            "batches_fed": self.batches_fed,
            "cache_read": self.cache_read,
            "calibrated_graph": self.calibrated_graph,
            "kept_layers": len(self.kept),
        }


def calibration_shape(spec: BuildSpec) -> tuple[str, tuple[int, ...]]:
    """(input name, kOPT shape of profile 0): the shape TensorRT calibrates at."""
    profile = profiles_from_json(spec.profiles)[0]
    if len(profile) != 1:
        raise UnavailableError(
            f"INT8 calibration feeds one image input; the model has inputs {sorted(profile)}"
        )
    ((name, shapes),) = profile.items()
    return name, shapes.opt


def configure_int8(
    api: TrtApi,
    network: trt.INetworkDefinition,
    config: trt.IBuilderConfig,
    profiles: list[trt.IOptimizationProfile],
    prepared: PreparedModel,
    spec: BuildSpec,
    req: Int8Request | None,
    rest_out: list[str] | None = None,
) -> Calibrator | None:
    """Configure INT8 on `config`; returns the calibrator (keep it alive until the build returns).
    `rest_out`: islands.rest_outputs of the parsed graph where it has an FP32 island (None: it has none)."""
    if not api.weakly_typed:
        return None  # strongly typed Q/DQ: precision is in the graph
    if not prepared.calibrate:
        req_flags = api.set_int8(config, None)  # Q/DQ on weakly typed TensorRT: flags, no calibrator
        if req is not None:
            req.flags = req_flags
        return None
    if req is None:
        raise BuildError(f"INT8 calibration of {prepared.onnx_path} was not configured (no Int8Request)")
    _, shape = calibration_shape(spec)
    # After a calibration of the graph without its FP32 island, the full build takes the scales from the
    # cache only: it gets no batches (feeding the island is what the pre-pass avoids).
    batches = None if req.calibrated_graph == "without_fp32_island" else req.batches
    feeder = BatchFeeder(batches, shape, req.samples, req.allocator)
    calibrator = make_calibrator(api, req.method, feeder, req.cache, quantile=req.quantile)
    if profiles:
        api.set_calibration_profile(config, profiles[0])
    req.flags = api.set_int8(config, calibrator)

    layers, outputs = api.network_layers(network)
    if rest_out is not None:
        # Select on the network without its FP32 island, whose outputs are the tensors the island reads:
        # @head walks back from them to the head convolutions (from the island's outputs it would stop
        # inside the graft), and no island layer is ever constrained to the kept precision (the island
        # is pinned to FP32: engines.build.trt_plan).
        island = islands.island_layers(layers, rest_out)
        layers, outputs = [x for x in layers if x.index not in island], rest_out
    chosen = select_layers(layers, outputs, req.keep_layers)
    for index in chosen:
        api.constrain_layer(network, index, req.keep_precision)
    names = {layer.index: layer.name for layer in layers}
    req.kept = {names[i]: why for i, why in chosen.items()}
    req.needs_constraints = bool(chosen)
    log.info(
        "INT8 (%s, %d samples): %d layers kept in %s: %s",
        req.method,
        req.samples,
        len(chosen),
        req.keep_precision,
        ", ".join(req.kept) or "none",
    )
    return calibrator


def finish_int8(calibrator: Calibrator | None, req: Int8Request | None, what: str = "the network") -> None:
    """Free the device buffer; surface a calibration error; fail when TensorRT neither fed a batch nor
    read a cache (no calibration happened); record what the calibration produced."""
    if calibrator is None or req is None:
        return
    calibrator.close()
    req.batches_fed += calibrator.feeder.batches_fed
    if calibrator.error is not None:
        raise BuildError(f"INT8 calibration failed: {calibrator.error}") from calibrator.error
    if calibrator.feeder.batches_fed == 0 and not calibrator.cache_read:
        raise BuildError(
            f"INT8 calibration of {what} did not happen: TensorRT asked for no calibration batch and read no "
            "calibration cache, so the engine would have no INT8 layer (TensorRT 7.1-8.0 skip calibration "
            "on networks with BOOL tensors or loops); refused"
        )
    req.cache_read = req.cache_read or calibrator.cache_read
    req.cache_sha256 = calibrator.cache_sha256
