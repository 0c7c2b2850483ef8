"""A tiny stand-in for the `tensorrt` module: only the attributes engines.trt probes and calls.

Used for what cannot run here (weakly typed TensorRT <= 10 builder flags, TensorRT 11 shapes, engine
deserialisation); everything that tensorrt_rtx can do for real is tested with tensorrt_rtx.

    trt = make("10.3.0")                       # weakly typed, EXPLICIT_BATCH + STRONGLY_TYPED flags
    trt = make("11.0.0", weak=False, explicit_batch=False)
    trt = make("8.2.0", memory_pool=False, opt_level=False, progress=False, node_names=False, io_api=True)
    trt = make("10.3.0", int8=True)            # + IInt8*Calibrator bases, PREFER/OBEY flags, layers
    trt = make("10.3.0", parsed=recorded_parse())   # the parser makes the real TensorRT-RTX parse of the
                                                    # grafted NanoDet (tests/data/nanodet_grafted_layers.json)
Every instance records calls in `trt.calls` (list of tuples).

INT8 (int8=True): the network has DETECTOR_LAYERS (names/types/tensors, settable precision and output
types), plus ISLAND_LAYERS when the parsed ONNX has an FP32 island (nodes named keep_fp32/...: the grafted
NMS tail, a loop and BOOL comparisons); build_serialized_network drives a config.int8_calibrator the way
TensorRT does (get_batch_size, read_calibration_cache, then get_batch until None, then
write_calibration_cache). FakeAllocator stands in for cuda-python device buffers.

Behaviours of real TensorRT the fake models, so the code around it is tested against them:
- TensorRT 7.1-8.0 skip INT8 calibration silently on networks with BOOL tensors or loops (the calibrator
  is never called; the engine gets no INT8 layer);
- both OBEY_ and PREFER_PRECISION_CONSTRAINTS set: the build fails (NvInfer.h: set exactly one);
- ONNX ops of TensorRT's plugin library (names ending in _TRT) parse only after init_libnvinfer_plugins;
  the library keeps only a weak reference to the logger it was given and logs through it whenever a plugin
  op is parsed (a RuntimeError once that logger is gone: a use-after-free crash in TensorRT);
- DLA (default_device_type DLA) refuses FP32 builds and profiles with min != max; can_run_on_DLA answers
  per layer type (DLA_LAYER_TYPES);
- add_optimization_profile returns -1 for a profile missing an input or with min > opt > max;
- a timing cache from another TensorRT version or device (mod._timing_device) is refused by
  set_timing_cache (returns False) unless mismatches are ignored; ITimingCache.combine skips (False) a cache
  of another version, and one of another device unless ignore_mismatch; unreadable cache bytes give None.
- runtime (see `_runtime_api` at the end): errors go to an error recorder where one is set (the engine
  and its contexts inherit the runtime's), else to the logger; a USER_MANAGED context fails
  execute_async_v3 by code without a large enough block; an output of data-dependent shape (-1 dims)
  needs an IOutputAllocator, which execute_async_v3 asks for the upper bound and then tells the shape.
Every plan records its layers and the precision each ran in (`plan_layers`), which the engine inspector
of the deserialised plan reports.
"""

from __future__ import annotations

import ctypes
import enum
import json
import types
import weakref
from pathlib import Path
from typing import Any

import numpy as np

PLAN_MAGIC = b"FAKEPLAN"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def _onnx_or_none(raw: bytes) -> Any:
    import onnx

    try:
        return onnx.load_from_string(raw) if raw else None
    except Exception:  # a placeholder file in a test: nothing to model
        return None


# (name, LayerType, input tensors, [(output tensor, DataType)]): a small detector. Stem conv, a backbone
# conv with a sigmoid gate, a shape op (INT32), and two heads (conv -> sigmoid/softmax -> reshape).
DETECTOR_LAYERS: list[tuple[str, str, list[str], list[tuple[str, str]]]] = [
    ("stem/Conv", "CONVOLUTION", ["images"], [("t0", "FLOAT")]),
    ("stem/Relu", "ACTIVATION", ["t0"], [("t1", "FLOAT")]),
    ("backbone/Conv_1", "CONVOLUTION", ["t1"], [("t2", "FLOAT")]),
    ("backbone/Sigmoid_gate", "ACTIVATION", ["t2"], [("t2g", "FLOAT")]),
    ("backbone/Mul", "ELEMENTWISE", ["t2", "t2g"], [("t2m", "FLOAT")]),
    ("shape/Shape", "SHAPE", ["t2m"], [("s0", "INT32")]),
    ("head/cls/Conv", "CONVOLUTION", ["t2m"], [("t3", "FLOAT")]),
    ("head/cls/Sigmoid", "ACTIVATION", ["t3"], [("t4", "FLOAT")]),
    ("head/cls/Reshape", "SHUFFLE", ["t4", "s0"], [("scores", "FLOAT")]),
    ("head/box/Conv", "CONVOLUTION", ["t2m"], [("t5", "FLOAT")]),
    ("head/box/Softmax", "SOFTMAX", ["t5"], [("t6", "FLOAT")]),
    ("head/box/Reshape", "SHUFFLE", ["t6", "s0"], [("boxes", "FLOAT")]),
]

# The grafted decode + NMS tail as the ONNX parser turns it into layers: a comparison (BOOL output) and a
# loop. Named as TensorRT's parser names them (tests/data/nanodet_grafted_layers.json, recorded from the
# real parser): layers made from a node keep its name (the engines.build.islands prefix), a constant is
# named after its initializer, broadcasts and loop layers get names of the parser's own.
ISLAND_LAYERS: list[tuple[str, str, list[str], list[tuple[str, str]]]] = [
    ("graft/thr_12", "CONSTANT", [], [("graft/thr_12_output", "FLOAT")]),
    ("ONNXTRT_Broadcast_13", "SHUFFLE", ["graft/thr_12_output"], [("ONNXTRT_Broadcast_13_output", "FLOAT")]),
    ("keep_fp32/Greater", "ELEMENTWISE", ["scores", "ONNXTRT_Broadcast_13_output"], [("keep", "BOOL")]),
    ("keep_fp32/Mul", "ELEMENTWISE", ["boxes", "scale"], [("pix", "FLOAT")]),
    ("(Unnamed Layer* 16) [TripLimit]", "TRIP_LIMIT", ["s0"], []),
    ("(Unnamed Layer* 17) [Recurrence]", "RECURRENCE", ["pix", "keep"], [("state", "FLOAT")]),
    ("(Unnamed Layer* 18) [LoopOutput]", "LOOP_OUTPUT", ["state"], [("det_boxes", "FLOAT")]),
]
# The real parse of the grafted NanoDet (tools/record_parsed_layers.py): make(parsed=recorded_parse()).
NANODET_GRAFTED_LAYERS = Path(__file__).resolve().parent / "data" / "nanodet_grafted_layers.json"


def recorded_parse(path: Path = NANODET_GRAFTED_LAYERS) -> dict[str, Any]:
    """A network as TensorRT's ONNX parser made it: inputs, outputs, layers [name, type, inputs, outputs,
    output dtypes, in the island-free parse], and the island-free parse's outputs and renamed layers."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data
LOOP_LAYER_TYPES = ("TRIP_LIMIT", "RECURRENCE", "LOOP_OUTPUT", "ITERATOR")
# Layer types the fake DLA runs (the rest falls back to the GPU).
DLA_LAYER_TYPES = ("CONVOLUTION", "ACTIVATION", "ELEMENTWISE", "SOFTMAX", "CONCATENATION")


LAYER_TYPES = (
    "CONVOLUTION",
    "ACTIVATION",
    "SHUFFLE",
    "SLICE",
    "CONSTANT",
    "SOFTMAX",
    "ELEMENTWISE",
    "CONCATENATION",
    "SHAPE",
    "QUANTIZE",
    "DEQUANTIZE",
    *LOOP_LAYER_TYPES,
)


class FakeDeviceBuffer:
    """Stands in for engines.cuda.buffers.DeviceBuffer: host bytes behind a made-up device pointer."""

    def __init__(self, allocator: FakeAllocator, nbytes: int, ptr: int) -> None:
        self.allocator, self.nbytes, self.ptr = allocator, nbytes, ptr
        self.data = bytearray(nbytes)
        self.freed = False

    def copy_from_host(self, array: np.ndarray) -> None:
        assert not self.freed, "copy into a freed buffer"
        raw = np.ascontiguousarray(array).tobytes()
        assert len(raw) <= self.nbytes, f"{len(raw)} bytes into a {self.nbytes}-byte buffer"
        self.data[: len(raw)] = raw
        self.allocator.copies.append((self.ptr, raw))

    def free(self) -> None:
        assert not self.freed, "double free"
        self.freed = True


class FakeAllocator:
    """Allocator for engines.build.calibrator.BatchFeeder: records allocations and every host->device copy."""

    def __init__(self) -> None:
        self.buffers: list[FakeDeviceBuffer] = []
        self.copies: list[tuple[int, bytes]] = []

    def __call__(self, nbytes: int) -> FakeDeviceBuffer:
        buf = FakeDeviceBuffer(self, nbytes, 0x7F00_0000 + 0x1000 * len(self.buffers))
        self.buffers.append(buf)
        return buf


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
    int8: bool = False,
    constraint_flags: tuple[str, ...] = ("PREFER_PRECISION_CONSTRAINTS", "OBEY_PRECISION_CONSTRAINTS"),
    calibrators: tuple[str, ...] = (
        "IInt8EntropyCalibrator2",
        "IInt8MinMaxCalibrator",
        "IInt8LegacyCalibrator",
    ),
    layers: list[tuple[str, str, list[str], list[tuple[str, str]]]] | None = None,
    parsed: dict[str, Any] | None = None,
) -> types.ModuleType:
    """`parsed` (recorded_parse()): the parser makes that recorded network, the whole of it from a graph
    with an FP32 island (keep_fp32/ nodes), its island-free part from one without (the INT8 pre-pass)."""
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
    flags = {"GPU_FALLBACK": 3, "REFIT": 4, "TF32": 6}
    if weak:
        flags.update(FP16=0, INT8=1)
    if int8:
        flags.update({name: 10 + i for i, name in enumerate(constraint_flags)})
    mod.BuilderFlag = enum.IntEnum("BuilderFlag", flags)
    mod.MemoryPoolType = enum.IntEnum("MemoryPoolType", {"WORKSPACE": 0})
    mod.DeviceType = enum.IntEnum("DeviceType", {"GPU": 0, "DLA": 1})
    mod.TensorIOMode = enum.IntEnum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
    mod.DataType = enum.IntEnum(
        "DataType",
        {
            "FLOAT": 0,
            "HALF": 1,
            "INT32": 3,
            "BOOL": 4,
            **({"INT8": 2} if int8 else {}),
            **({"INT64": 8} if parsed else {}),
        },
    )
    mod.nptype = lambda dt: {0: np.float32, 1: np.float16, 2: np.int8, 3: np.int32}[int(dt)]

    class ILogger:
        class Severity(enum.IntEnum):
            INTERNAL_ERROR = 0
            ERROR = 1
            WARNING = 2
            INFO = 3

        def __init__(self) -> None:
            pass

    mod.ILogger = ILogger
    _runtime_api(mod)  # error recorders, output allocators, context memory (below make)
    mod.plugins_registered = False

    def init_libnvinfer_plugins(logger: Any, namespace: str) -> bool:
        calls.append(("init_libnvinfer_plugins", namespace))
        mod.plugins_registered = True
        # The plugin library keeps a raw pointer to this logger (the binding has no keep_alive): a weak one.
        mod._plugin_logger = weakref.ref(logger)
        return True

    def plugin_log(msg: str) -> None:
        """A plugin logs (on every creation/deserialisation) to the logger it was registered with: a crash
        in TensorRT where that logger is gone; a RuntimeError here."""
        logger = mod._plugin_logger() if mod._plugin_logger is not None else None
        if logger is None:
            raise RuntimeError("use after free: the plugin library logs to a logger that was destroyed")
        logger.log(ILogger.Severity.WARNING, msg)

    mod._plugin_logger = None

    mod.init_libnvinfer_plugins = init_libnvinfer_plugins

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

    class Tensor:
        def __init__(self, name: str, dtype: Any) -> None:
            self.name, self.dtype = name, dtype

    class Layer:
        def __init__(self, name: str, kind: str, inputs: list[Tensor], outputs: list[Tensor]) -> None:
            self.name, self.type = name, mod.LayerType[kind]
            self._inputs, self._outputs = inputs, outputs
            self.precision: Any = None  # None: not constrained
            self.output_types: dict[int, Any] = {}

        @property
        def num_inputs(self) -> int:
            return len(self._inputs)

        @property
        def num_outputs(self) -> int:
            return len(self._outputs)

        def get_input(self, i: int) -> Tensor:
            return self._inputs[i]

        def get_output(self, i: int) -> Tensor:
            return self._outputs[i]

        def set_output_type(self, i: int, dtype: Any) -> None:
            self.output_types[i] = dtype

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags = flags
            self.layers: list[Layer] = []
            self.outputs: list[Tensor] = []
            self._qdq = False
            self.tensors: dict[str, Tensor] = {
                "images": Tensor("images", mod.DataType.FLOAT),
                "thr": Tensor("thr", mod.DataType.FLOAT),
                "scale": Tensor("scale", mod.DataType.FLOAT),
            }
            if int8 and parsed is None:
                self._add(layers or DETECTOR_LAYERS)
                self.outputs = [self.tensors["scores"], self.tensors["boxes"]]
            mod.last_network = self

        def _add_parsed(self, island: bool) -> None:
            """The recorded parse: all of it (`island`), or the layers the island-free parse has."""
            assert parsed is not None
            specs = [x for x in parsed["layers"] if island or x[5]]
            renames = {} if island else parsed["island_free_renames"]
            self.tensors.update({t: Tensor(t, mod.DataType.FLOAT) for t in parsed["inputs"]})
            for _, _, _, outs, dtypes, _ in specs:  # a loop reads tensors made further on
                made = zip(outs, dtypes, strict=True)
                self.tensors.update({t: Tensor(t, mod.DataType[d]) for t, d in made})
            for name, kind, ins, outs, _, _ in specs:
                made = [self.tensors[t] for t in outs]
                reads = [None if t is None else self.tensors[t] for t in ins]
                self.layers.append(Layer(renames.get(name, name), kind, reads, made))
            self.outputs = [self.tensors[t] for t in parsed["outputs" if island else "island_free_outputs"]]

        def _add(self, specs: list[tuple[str, str, list[str], list[tuple[str, str]]]]) -> None:
            for name, kind, ins, outs in specs:
                made = [Tensor(o, mod.DataType[dt]) for o, dt in outs]
                self.tensors.update({t.name: t for t in made})
                self.layers.append(Layer(name, kind, [self.tensors[i] for i in ins], made))

        def _add_island(self) -> None:
            """The parser met an FP32 island (keep_fp32/ nodes): its layers and output join the network."""
            if int8 and not any(layer.name.startswith("keep_fp32/") for layer in self.layers):
                self._add(ISLAND_LAYERS)
                self.outputs.append(self.tensors["det_boxes"])

        @property
        def _has_bool_or_loop(self) -> bool:
            return any(
                layer.type.name in LOOP_LAYER_TYPES
                or any(t.dtype == mod.DataType.BOOL for t in layer._outputs)
                for layer in self.layers
            )

        @property
        def num_layers(self) -> int:
            return len(self.layers)

        def get_layer(self, i: int) -> Layer:
            return self.layers[i]

        @property
        def num_outputs(self) -> int:
            return len(self.outputs)

        def get_output(self, i: int) -> Tensor:
            return self.outputs[i]

    class OnnxParser:
        def __init__(self, network: Network, logger: Any) -> None:
            self.network = network
            self.errors = [ParserError(*e) for e in (parse_errors or [])]

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, i: int) -> ParserError:
            return self.errors[i]

        def _read(self, model: Any) -> bool:
            """What the real parser does with the graph, as far as the fake models it: plugin ops need the
            plugin registry; an FP32 island adds its layers. Bytes that are not ONNX are taken as they are
            (tests hand the fake placeholder files)."""
            nodes = list(model.graph.node) if model is not None else []
            for node in nodes:
                if node.op_type.endswith("_TRT") and mod.plugins_registered:
                    plugin_log(f"{node.op_type} plugin is deprecated")  # the NMS plugins say so each time
                if node.op_type.endswith("_TRT") and not mod.plugins_registered:
                    self.errors.append(
                        ParserError(
                            node.name,
                            node.op_type,
                            f"No importer registered for op: {node.op_type}. Attempting to import as "
                            "plugin. Plugin not found (init_libnvinfer_plugins not called?)",
                        )
                    )
            if any(n.op_type == "DequantizeLinear" for n in nodes):
                self.network._qdq = True  # the parser makes IDequantizeLayers: scales are in the graph
            has_island = any(n.name.startswith("keep_fp32/") for n in nodes)
            if parsed is not None:
                self.network._add_parsed(has_island)
            elif has_island:
                self.network._add_island()
            return not self.errors

        def parse(self, data: bytes) -> bool:
            calls.append(("parse", "bytes", len(data)))
            return self._read(_onnx_or_none(bytes(data)))

        def parse_from_file(self, path: str) -> bool:
            calls.append(("parse", "file", path))
            try:
                raw = Path(path).read_bytes()
            except OSError:
                raw = b""
            return self._read(_onnx_or_none(raw))

    mod.OnnxParser = OnnxParser
    mod._timing_device = "gpu0"  # the device new timing caches name in their header

    class TimingCache:
        """Serialised as "trt<version>[@<device>];key,key": a cache remembers the TensorRT and the device
        (mod._timing_device) that made it, as TensorRT's cache header does."""

        def __init__(self, data: bytes) -> None:
            text = data.decode(errors="replace")
            head, _, keys = text.partition(";") if ";" in text else (version, "", text)
            made_by, _, device = head.removeprefix("trt").partition("@")
            self.version, self._device = made_by, device or mod._timing_device
            self.keys = [k for k in keys.split(",") if k]

        def queryKeys(self) -> list[str]:
            return list(self.keys)

        def combine(self, other: TimingCache, ignore_mismatch: bool) -> bool:
            """ITimingCache::combine: a cache of another TensorRT version is skipped (False) whatever the
            flag; one of another device is merged only with ignore_mismatch."""
            if other.version != self.version or (other._device != self._device and not ignore_mismatch):
                return False
            self.keys = sorted(set(self.keys) | set(other.keys))
            return True

        def serialize(self) -> bytes:
            return f"trt{self.version}@{self._device};{','.join(self.keys)}".encode()

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[Any, ...]] = {}

        def set_shape(self, name: str, mn: Any, opt: Any, mx: Any) -> None:
            self.shapes[name] = (tuple(mn), tuple(opt), tuple(mx))

        @property
        def _valid(self) -> bool:
            return bool(self.shapes) and all(
                len(a) == len(b) == len(c) and all(x <= y <= z for x, y, z in zip(a, b, c, strict=True))
                for a, b, c in self.shapes.values()
            )

    def create_timing_cache(self: Any, data: Any) -> TimingCache | None:
        raw = bytes(data)
        if raw and not raw.startswith(b"trt"):
            return None  # TensorRT cannot read it
        return TimingCache(raw)

    def set_timing_cache(self: Any, cache: TimingCache, ignore_mismatch: bool) -> bool:
        if (cache.version, cache._device) != (version, mod._timing_device) and not ignore_mismatch:
            return False  # made by another TensorRT (or device): refused
        self.timing_cache = cache
        return True

    def add_optimization_profile(self: Any, profile: Profile) -> int:
        if not profile._valid:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def can_run_on_dla(self: Any, layer: Layer) -> bool:
        return self.default_device_type == mod.DeviceType.DLA and layer.type.name in DLA_LAYER_TYPES

    config_attrs: dict[str, Any] = {}

    def cfg_init(self: Any) -> None:
        self.flags_set = []
        self.cleared = []
        self.profiles = []
        self.pool_limits = {}
        self.timing_cache = None

    config_attrs["__init__"] = cfg_init
    config_attrs["set_flag"] = lambda self, f: self.flags_set.append(f)
    config_attrs["clear_flag"] = lambda self, f: (
        self.cleared.append(("clear_flag", f)),
        setattr(self, "flags_set", [x for x in self.flags_set if x != f]),
    )
    config_attrs["add_optimization_profile"] = add_optimization_profile
    config_attrs["create_timing_cache"] = create_timing_cache
    config_attrs["set_timing_cache"] = set_timing_cache
    config_attrs["can_run_on_DLA"] = can_run_on_dla
    if int8:
        config_attrs["int8_calibrator"] = None
        config_attrs["set_calibration_profile"] = lambda self, p: calls.append(("calibration_profile", p))
    config_attrs["DLA_core"] = -1
    config_attrs["profiling_verbosity"] = None  # set to ProfilingVerbosity.DETAILED by the agent's builds
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

        def _refuse(self, why: str) -> None:
            self.logger.log(ILogger.Severity.ERROR, why)

        def build_serialized_network(self, network: Network, config: Any) -> bytes | None:
            calls.append(("build", config))
            flags = config.flags_set
            names = {mod.BuilderFlag(f).name for f in flags}
            if {"OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"} <= names:
                self._refuse("Invalid configuration: both OBEY and PREFER precision constraints are set")
                return None
            if config.default_device_type == mod.DeviceType.DLA:
                if not names & {"FP16", "INT8"}:
                    self._refuse("DLA requires FP16 or INT8 precision (no FP32 on DLA)")
                    return None
                if any(s[0] != s[2] for p in config.profiles for s in p.shapes.values()):
                    self._refuse("DLA supports only static shapes: profile min must equal max")
                    return None
            mon = getattr(config, "progress_monitor", None)
            if mon is not None:
                mon.phase_start("Building engine", None, 2)
                mon.step_complete("Building engine", 0)
                mon.step_complete("Building engine", 1)
                mon.phase_finish("Building engine")
            if config.timing_cache is not None:
                config.timing_cache.keys = sorted({*config.timing_cache.keys, "conv1", "conv2"})
            cal = getattr(config, "int8_calibrator", None)
            scales = False
            if cal is not None and "INT8" in names:
                if (7, 1) <= _version_tuple(version) < (8, 2) and network._has_bool_or_loop:
                    calls.append(("calib_skipped", "bool/loop network"))  # silently, as those versions did
                else:
                    scales = _calibrate(
                        cal, list(config.profiles[0].shapes) if config.profiles else ["images"]
                    )
            elif network._qdq and ("INT8" in names or not weak):  # strongly typed: no flag needed
                scales = True  # Q/DQ network: the scales are in the graph
            shapes = config.profiles[0].shapes if config.profiles else {}
            plan_layers = [
                [layer.name, layer.type.name, _layer_precision(layer, names, scales)]
                for layer in network.layers
            ]
            mod.last_plan_layers = plan_layers
            return (
                PLAN_MAGIC
                + json.dumps({"shapes": repr(sorted(shapes.items())), "layers": plan_layers}).encode()
            )

    mod.Builder = Builder

    def _calibrate(cal: Any, names: list[str]) -> bool:
        """TensorRT's order: batch size, cache; without a cache, batches until None, then write the cache.
        True when scales came out of it (a cache, or at least one batch)."""
        calls.append(("calib_batch_size", cal.get_batch_size()))
        if hasattr(cal, "get_quantile"):
            calls.append(("calib_quantile", cal.get_quantile(), cal.get_regression_cutoff()))
        cached = cal.read_calibration_cache()
        if cached:
            calls.append(("calib_cache_read", bytes(cached)))
            return True
        n = 0
        while True:
            ptrs = cal.get_batch(names)
            if not ptrs:
                break
            n += 1
            calls.append(("calib_batch", list(ptrs)))
        cal.write_calibration_cache(memoryview(f"FAKE-CALIB-{n}-batches".encode()))
        return n > 0

    def _layer_precision(layer: Layer, flags: set[str], scales: bool) -> str:
        """What the fake builder runs a layer in: a constraint wins (where a constraint flag is set), else
        INT8 for convolutions with scales, else FP16 with the FP16 flag, else FP32."""
        constrained = flags & {"OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS", "STRICT_TYPES"}
        if layer.precision is not None and constrained:
            return mod.DataType(layer.precision).name
        if scales and layer.type.name == "CONVOLUTION":
            return "INT8"
        return "HALF" if "FP16" in flags else "FLOAT"

    if int8 or parsed:
        kinds = dict.fromkeys([*LAYER_TYPES, *(x[1] for x in (parsed or {}).get("layers", []))])
        mod.LayerType = enum.IntEnum("LayerType", {k: i for i, k in enumerate(kinds)})
    if int8:

        def calibrator_class(name: str) -> type:
            def init(self: Any) -> None:
                self.base_initialised = True  # a real trampoline crashes without this call

            return type(name, (), {"__init__": init})

        for name in calibrators:
            setattr(mod, name, calibrator_class(name))

    mod.LayerInformationFormat = enum.IntEnum("LayerInformationFormat", {"ONELINE": 0, "JSON": 1})
    _DATATYPE_WORDS = {"INT8": "Int8", "HALF": "Half", "FLOAT": "Float", "INT32": "Int32", "BOOL": "Bool"}

    class EngineInspector:
        """IEngineInspector: the layers of the plan as its builder recorded them, in the JSON format."""

        def __init__(self, layers: list[list[str]]) -> None:
            self._layers = layers
            self.execution_context: Any = None

        def get_engine_information(self, fmt: Any) -> str:
            assert fmt == mod.LayerInformationFormat.JSON, "the fake speaks JSON only"
            return json.dumps(
                {
                    "Layers": [
                        {
                            "Name": name,
                            "LayerType": kind,
                            "Inputs": [{"Format/Datatype": _DATATYPE_WORDS[prec]}],
                        }
                        for name, kind, prec in self._layers
                    ]
                }
            )

    class Engine:
        def __init__(self, io: list[tuple[str, int, tuple[int, ...], int, Any]], plan: bytes = b"") -> None:
            self.io = io
            body = plan[len(PLAN_MAGIC) :]
            self._layers: list[list[str]] = json.loads(body)["layers"] if body.startswith(b"{") else []
            if io_api:
                self.num_io_tensors = len(io)
            self.num_optimization_profiles = mod.ENGINE_PROFILES

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
            return self._t(name)[4]  # every profile alike

        def create_execution_context(self, strategy: Any = None) -> ExecutionContext:
            return ExecutionContext(self, strategy)

        def get_device_memory_size_for_profile_v2(self, index: int) -> int:
            return _activation_bytes(mod, self, index)

        @property
        def device_memory_size_v2(self) -> int:  # STATIC: the largest over every profile
            return max(_activation_bytes(mod, self, p) for p in range(self.num_optimization_profiles))

        def create_engine_inspector(self) -> EngineInspector:
            return EngineInspector(self._layers)

    mod.ICudaEngine = Engine

    class ExecutionContext:
        """IExecutionContext as engines.runtimes.slots drives it (not exposed as mod.IExecutionContext:
        the module probes of older versions must still find no execution API). Shapes follow the engine's
        IO; execute_async_v3 computes nothing (the fake cudart's device memory stays as it is)."""

        def __init__(self, engine: Engine, strategy: Any = None) -> None:
            self.engine = engine
            _context_memory(mod, self, strategy)  # _device_memory_bytes, error_recorder, output allocators
            # The default is the verbosity the engine was built with (agent engines: DETAILED).
            self.nvtx_verbosity = mod.ProfilingVerbosity.DETAILED
            self.profiler: Any = None
            self.active_optimization_profile = 0
            self.shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}

        def set_optimization_profile_async(self, index: int, stream: int) -> bool:
            if not 0 <= index < self.engine.num_optimization_profiles:
                return False
            self.active_optimization_profile = index
            return True

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            if not any(t[0] == name for t in self.engine.io):
                return False
            self.addresses[name] = int(ptr)
            return True

        def set_input_shape(self, name: str, shape: Any) -> bool:
            t = self.engine._t(name)
            lo, _, hi = t[4]
            shape = tuple(int(d) for d in shape)
            fits = len(shape) == len(lo) and all(a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True))
            if t[1] != 1 or not fits:
                return False
            self.shapes[name] = shape
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            t = self.engine._t(name)
            if t[1] == 1:
                return self.shapes.get(name, t[2])
            if name in mod._ENGINE_DDS:  # data-dependent: -1 until the batch ran (notify_shape says)
                return t[2]
            batch = next(iter(self.shapes.values()), (-1,))[0]  # outputs follow the input's batch
            return (batch, *t[2][1:])

        def execute_async_v3(self, stream: int) -> bool:
            level = mod.ProfilingVerbosity(self.nvtx_verbosity).name
            calls.append(("execute_async_v3", dict(self.shapes), level))
            if not _execute_checks(mod, self, stream):  # memory, allocators: errors as TensorRT reports
                return False
            return len(self.addresses) + len(self._output_allocators) == len(self.engine.io)

        set_device_memory = _set_device_memory
        set_output_allocator = _set_output_allocator

    if not hasattr(mod, "ProfilingVerbosity"):
        mod.ProfilingVerbosity = enum.IntEnum(
            "ProfilingVerbosity", {"LAYER_NAMES_ONLY": 0, "NONE": 1, "DETAILED": 2}
        )
    # The engine every fake plan deserialises to: dynamic batch 1..8, two outputs; ENGINE_PROFILES
    # optimisation profiles (the builder makes the profile set once per context: streams x the set).
    mod.ENGINE_IO = [
        ("images", 1, (-1, 3, 416, 416), 0, [(1, 3, 416, 416), (4, 3, 416, 416), (8, 3, 416, 416)]),
        ("scores", 2, (-1, 3598, 80), 0, None),
        ("boxes", 2, (-1, 3598, 32), 1, None),
    ]
    mod.ENGINE_PROFILES = 1
    # The next `refuse_loads` plans are refused with `refusal` (a TensorRT patch the manifest check missed).
    mod.refuse_loads = 0
    mod.refusal = (
        "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error (The engine plan file is not "
        f"compatible with this version of TensorRT, expecting library version {version}.1 got {version}.0, "
        "please rebuild.)"
    )

    class Runtime:
        def __init__(self, logger: Any) -> None:
            self.logger = logger
            self._dla_core = -1
            self.error_recorder: Any = None  # set: errors go to it instead of the logger (as RTX 1.7 does)

        @property
        def DLA_core(self) -> int:
            return self._dla_core

        @DLA_core.setter
        def DLA_core(self, core: int) -> None:
            calls.append(("Runtime.DLA_core", core))
            self._dla_core = core

        def deserialize_cuda_engine(self, plan: bytes) -> Engine | None:
            calls.append(("deserialize_cuda_engine", self._dla_core))
            if not bytes(plan).startswith(PLAN_MAGIC):
                _report(mod, self, "UNSPECIFIED_ERROR", "Serialization assertion magicTag failed")
                return None
            if mod.refuse_loads > 0:
                mod.refuse_loads -= 1
                _report(mod, self, "UNSPECIFIED_ERROR", mod.refusal)
                return None
            if mod._load_failure is not None:  # the device's fault: (ErrorCode name, description)
                _report(mod, self, *mod._load_failure)
                return None
            engine = Engine(mod.ENGINE_IO, bytes(plan))
            engine.error_recorder = self.error_recorder  # inherited, as TensorRT passes it along
            return engine

    mod.Runtime = Runtime
    return mod


# ---- the runtime API of TensorRT 10 that engines.runtimes.slots uses beyond the basics -----------------
# Modelled on NvInferRuntime.h / the Python API docs (tensorrt-stubs 10.13) and, for error recorders, on
# TensorRT-RTX 1.7 measured here: once a recorder is set, errors go to it and not to the logger, and a
# failed magic tag and cudaError 35 both come as UNSPECIFIED_ERROR.
#   mod._ENGINE_DDS = {"detections": 5}   outputs of data-dependent shape (-1 dims in ENGINE_IO) and the
#                                        rows the next executions produce; _DDS_MAX_ROWS: the upper bound
#   mod._load_failure = ("FAILED_ALLOCATION", "...")   the next loads fail for the device's sake
#   mod._ACTIVATION_BYTES_PER_INPUT_BYTE   the fake's device_memory_size model: activations per input byte
#                                         at the profile's max shape


def _runtime_api(mod: Any) -> None:
    mod.ErrorCodeTRT = enum.IntEnum(
        "ErrorCodeTRT",
        [
            "SUCCESS", "UNSPECIFIED_ERROR", "INTERNAL_ERROR", "INVALID_ARGUMENT", "INVALID_CONFIG",
            "FAILED_ALLOCATION", "FAILED_INITIALIZATION", "FAILED_EXECUTION", "FAILED_COMPUTATION",
            "INVALID_STATE", "UNSUPPORTED_STATE",
        ],
        start=0,
    )  # fmt: skip
    mod.ExecutionContextAllocationStrategy = enum.IntEnum(
        "ExecutionContextAllocationStrategy", {"STATIC": 0, "ON_PROFILE_CHANGE": 1, "USER_MANAGED": 2}
    )

    class IErrorRecorder:
        def __init__(self) -> None:
            pass

    class IOutputAllocator:
        def __init__(self) -> None:
            pass

    mod.IErrorRecorder, mod.IOutputAllocator = IErrorRecorder, IOutputAllocator
    mod._ENGINE_DDS = {}
    mod._DDS_MAX_ROWS = 100
    mod._load_failure = None
    mod._ACTIVATION_BYTES_PER_INPUT_BYTE = 2
    mod._static_context_bytes = 0  # activation memory TensorRT itself allocated for STATIC contexts


def _report(mod: Any, owner: Any, code: str, desc: str) -> None:
    """An error the way TensorRT reports it: to the owner's recorder if one is set, else its logger."""
    recorder = getattr(owner, "error_recorder", None)
    if recorder is not None:
        recorder.report_error(mod.ErrorCodeTRT[code], desc)
    elif getattr(owner, "logger", None) is not None:
        owner.logger.log(mod.ILogger.Severity.ERROR, desc)


def _activation_bytes(mod: Any, engine: Any, profile: int) -> int:
    """The fake's get_device_memory_size_for_profile: a multiple of the input's bytes at the profile's
    max shape (every fake profile is alike)."""
    inp = next(t for t in engine.io if t[1] == 1)
    hi = inp[4][2]
    return int(np.prod(hi)) * 4 * mod._ACTIVATION_BYTES_PER_INPUT_BYTE


def _context_memory(mod: Any, ctx: Any, strategy: Any) -> None:
    ctx._mod = mod
    ctx._strategy = mod.ExecutionContextAllocationStrategy(strategy or 0)
    ctx.error_recorder = getattr(ctx.engine, "error_recorder", None)
    ctx._output_allocators = {}
    ctx._device_memory_bytes = 0
    if ctx._strategy != mod.ExecutionContextAllocationStrategy.USER_MANAGED:
        ctx._device_memory_bytes = ctx.engine.device_memory_size_v2  # TensorRT allocates it itself
        mod._static_context_bytes += ctx._device_memory_bytes


def _set_device_memory(ctx: Any, memory: int, size: int) -> None:
    ctx.device_memory, ctx._device_memory_bytes = int(memory), int(size)


def _set_output_allocator(ctx: Any, name: str, allocator: Any) -> bool:
    if name not in ctx._mod._ENGINE_DDS or not any(t[0] == name for t in ctx.engine.io):
        return False
    ctx._output_allocators[name] = allocator
    return True


def _execute_checks(mod: Any, ctx: Any, stream: int) -> bool:
    """What execute_async_v3 checks and does beyond the addresses: a user-managed context needs its
    memory (at least the active profile's size); a data-dependent output needs an allocator, which is
    asked for the upper bound of bytes (reallocate_output_async where defined, else reallocate_output),
    gets the rows written at the address it returned (the fake cudart's memory is host memory), and is
    told the shape (notify_shape)."""
    if ctx._strategy == mod.ExecutionContextAllocationStrategy.USER_MANAGED:
        need = ctx.engine.get_device_memory_size_for_profile_v2(ctx.active_optimization_profile)
        if ctx._device_memory_bytes < need:
            why = f"enqueueV3: device memory {ctx._device_memory_bytes} < {need} bytes"
            _report(mod, ctx, "INVALID_STATE", why)
            return False
    for name, rows in mod._ENGINE_DDS.items():
        allocator = ctx._output_allocators.get(name)
        if allocator is None:
            if name not in ctx.addresses:
                why = f"enqueueV3: output {name} has neither an address nor an allocator"
                _report(mod, ctx, "INVALID_STATE", why)
                return False
            continue
        t = ctx.engine._t(name)
        width = [d for d in t[2] if d >= 0]
        dtype = np.dtype(mod.nptype(mod.DataType(t[3])))
        bound = mod._DDS_MAX_ROWS * int(np.prod(width)) * dtype.itemsize
        if hasattr(allocator, "reallocate_output_async"):
            ptr = allocator.reallocate_output_async(name, 0, bound, 256, stream)
        else:
            ptr = allocator.reallocate_output(name, 0, bound, 256)
        if not ptr:
            _report(mod, ctx, "FAILED_ALLOCATION", f"enqueueV3: output allocator gave no memory for {name}")
            return False
        data = np.arange(rows * int(np.prod(width)), dtype=dtype)  # row i: i*width ...
        ctypes.memmove(int(ptr), data.ctypes.data, data.nbytes)
        allocator.notify_shape(name, (rows, *width))
    return True
