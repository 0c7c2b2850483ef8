"""TensorRT and TensorRT-RTX: every version/flavour difference, in one place.

    api = import_trt()            # tensorrt if importable, else tensorrt_rtx; or import_trt("tensorrt_rtx")
    api = TrtApi(module)          # wrap an already imported module (tests pass `fake_tensorrt`)

module (identity, probes and the facts behind them, logger, plugins), network, config, timing_cache and
runtime (the calls, by job), api (TrtApi, all of them together, and import_trt).
"""

from engines.trt.api import TrtApi, import_trt
from engines.trt.module import FLAVORS, ProgressCallback, flavor_label
from engines.trt.network import LayerInfo
from engines.trt.runtime import IoTensor

__all__ = ["FLAVORS", "IoTensor", "LayerInfo", "ProgressCallback", "TrtApi", "flavor_label", "import_trt"]
