"""A tiny stand-in for the `tensorrt` module: only the attributes engines.trt_api probes and calls.

Used for what cannot run here (weakly typed TensorRT <= 10 builder flags, TensorRT 11 shapes, engine
deserialisation); everything that tensorrt_rtx can do for real is tested with tensorrt_rtx.

    trt = make("10.3.0")                       # weakly typed, EXPLICIT_BATCH + STRONGLY_TYPED flags
    trt = make("11.0.0", weak=False, explicit_batch=False)
    trt = make("8.2.0", memory_pool=False, opt_level=False, progress=False, node_names=False, io_api=True)
Every instance records calls in `trt.calls` (list of tuples).
"""

from __future__ import annotations

import enum
import types
from typing import Any

import numpy as np

PLAN_MAGIC = b"FAKEPLAN"


def make(
    version: str = "10.3.0",
    *,
    weak: bool = True,
    explicit_batch: bool = True,
    strongly_typed_flag: bool = True,
    memory_pool: bool = True,
    opt_level: bool = True,
    progress: bool = True,
    node_names: bool = True,
    io_api: bool = True,
    dla_cores: int = 0,
    parse_errors: list[tuple[str, str, str]] | None = None,
) -> types.ModuleType:
    mod = types.ModuleType("fake_tensorrt")
    mod.__version__ = version
    calls: list[tuple[Any, ...]] = []
    mod.calls = calls

    ndcf = {}
    if explicit_batch:
        ndcf["EXPLICIT_BATCH"] = 0
    if strongly_typed_flag:
        ndcf["STRONGLY_TYPED"] = 1
    mod.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", ndcf or {"_NONE": 9})
    flags = {"GPU_FALLBACK": 3, "REFIT": 4}
    if weak:
        flags.update(FP16=0, INT8=1)
    mod.BuilderFlag = enum.IntEnum("BuilderFlag", flags)
    mod.MemoryPoolType = enum.IntEnum("MemoryPoolType", {"WORKSPACE": 0})
    mod.DeviceType = enum.IntEnum("DeviceType", {"GPU": 0, "DLA": 1})
    mod.TensorIOMode = enum.IntEnum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
    mod.DataType = enum.IntEnum("DataType", {"FLOAT": 0, "HALF": 1, "INT32": 3})
    mod.nptype = lambda dt: {0: np.float32, 1: np.float16, 3: np.int32}[int(dt)]

    class ILogger:
        class Severity(enum.IntEnum):
            INTERNAL_ERROR = 0
            ERROR = 1
            WARNING = 2
            INFO = 3

        def __init__(self) -> None:
            pass

    mod.ILogger = ILogger

    if progress:

        class IProgressMonitor:
            def __init__(self) -> None:
                pass

        mod.IProgressMonitor = IProgressMonitor

    class ParserError:
        def __init__(self, name: str, op: str, desc: str) -> None:
            self._name, self._op, self._desc = name, op, desc

        def desc(self) -> str:
            return self._desc

        def node(self) -> int:
            return 3

        def code(self) -> str:
            return "ErrorCode.UNSUPPORTED_NODE"

    if node_names:
        ParserError.node_name = lambda self: self._name
        ParserError.node_operator = lambda self: self._op

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags = flags

    class OnnxParser:
        def __init__(self, network: Network, logger: Any) -> None:
            self.errors = [ParserError(*e) for e in (parse_errors or [])]

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, i: int) -> ParserError:
            return self.errors[i]

        def parse(self, data: bytes) -> bool:
            calls.append(("parse", "bytes", len(data)))
            return not self.errors

        def parse_from_file(self, path: str) -> bool:
            calls.append(("parse", "file", path))
            return not self.errors

    mod.OnnxParser = OnnxParser

    class TimingCache:
        def __init__(self, data: bytes) -> None:
            self.keys = [k for k in data.decode().split(",") if k]

        def queryKeys(self) -> list[str]:
            return list(self.keys)

        def combine(self, other: TimingCache, ignore_mismatch: bool) -> bool:
            self.keys = sorted(set(self.keys) | set(other.keys))
            return True

        def serialize(self) -> bytes:
            return ",".join(self.keys).encode()

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[Any, ...]] = {}

        def set_shape(self, name: str, mn: Any, opt: Any, mx: Any) -> None:
            self.shapes[name] = (tuple(mn), tuple(opt), tuple(mx))

    config_attrs: dict[str, Any] = {}

    def cfg_init(self: Any) -> None:
        self.flags_set = []
        self.profiles = []
        self.pool_limits = {}
        self.timing_cache = None

    config_attrs["__init__"] = cfg_init
    config_attrs["set_flag"] = lambda self, f: self.flags_set.append(f)
    config_attrs["add_optimization_profile"] = lambda self, p: self.profiles.append(p)
    config_attrs["create_timing_cache"] = lambda self, data: TimingCache(bytes(data))
    config_attrs["set_timing_cache"] = lambda self, cache, ignore: (
        setattr(self, "timing_cache", cache) or True
    )
    config_attrs["DLA_core"] = -1
    config_attrs["default_device_type"] = None
    if memory_pool:
        config_attrs["set_memory_pool_limit"] = lambda self, pool, n: self.pool_limits.__setitem__(pool, n)
    else:
        config_attrs["max_workspace_size"] = 0
    if opt_level:
        config_attrs["builder_optimization_level"] = 3
    if progress:
        config_attrs["progress_monitor"] = None
    IBuilderConfig = type("IBuilderConfig", (), config_attrs)
    mod.IBuilderConfig = IBuilderConfig

    class Builder:
        num_DLA_cores = dla_cores

        def __init__(self, logger: Any) -> None:
            self.logger = logger

        def create_network(self, flags: int = 0) -> Network:
            calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self) -> Any:
            return IBuilderConfig()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Any) -> bytes:
            calls.append(("build", config))
            mon = getattr(config, "progress_monitor", None)
            if mon is not None:
                mon.phase_start("Building engine", None, 2)
                mon.step_complete("Building engine", 0)
                mon.step_complete("Building engine", 1)
                mon.phase_finish("Building engine")
            if config.timing_cache is not None:
                config.timing_cache.keys = sorted({*config.timing_cache.keys, "conv1", "conv2"})
            shapes = config.profiles[0].shapes if config.profiles else {}
            return PLAN_MAGIC + repr(sorted(shapes.items())).encode()

    mod.Builder = Builder

    class Engine:
        def __init__(self, io: list[tuple[str, int, tuple[int, ...], int, Any]]) -> None:
            self.io = io
            if io_api:
                self.num_io_tensors = len(io)

        def get_tensor_name(self, i: int) -> str:
            return self.io[i][0]

        def _t(self, name: str) -> tuple[str, int, tuple[int, ...], int, Any]:
            return next(t for t in self.io if t[0] == name)

        def get_tensor_mode(self, name: str) -> Any:
            return mod.TensorIOMode(self._t(name)[1])

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return self._t(name)[2]

        def get_tensor_dtype(self, name: str) -> Any:
            return mod.DataType(self._t(name)[3])

        def get_tensor_profile_shape(self, name: str, index: int) -> Any:
            return self._t(name)[4]

        def create_execution_context(self) -> object:
            return object()

    # The engine every fake plan deserialises to: dynamic batch 1..8, two outputs.
    mod.ENGINE_IO = [
        ("images", 1, (-1, 3, 416, 416), 0, [(1, 3, 416, 416), (4, 3, 416, 416), (8, 3, 416, 416)]),
        ("scores", 2, (-1, 3598, 80), 0, None),
        ("boxes", 2, (-1, 3598, 32), 1, None),
    ]

    class Runtime:
        def __init__(self, logger: Any) -> None:
            self.logger = logger

        def deserialize_cuda_engine(self, plan: bytes) -> Engine | None:
            if not bytes(plan).startswith(PLAN_MAGIC):
                self.logger.log(ILogger.Severity.ERROR, "Serialization assertion magicTag failed")
                return None
            return Engine(mod.ENGINE_IO)

    mod.Runtime = Runtime
    return mod
