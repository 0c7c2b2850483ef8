"""What the config names must exist and fit, checked before anything starts (`run`, `--check-config`, reload).

The schema (agent.config) checks types, ranges and the form of every value; this checks them against the
host: the ONNX model (readable, an ONNX graph whose outputs the configured `format` decodes), the labels
(UTF-8, not empty), camera classes and zone/line labels against those labels, a camera's video file, what
a GStreamer `pipeline` or `preprocess: gpu` needs from this host, a TensorRT backend asked for by name,
engine_dir where TensorRT will serve (creatable, writable), the Prometheus port (free to listen on), and
on a Jetson that `tensorrt` is JetPack's, not a pip wheel shadowing it (engines.trt.jetpack).
Every problem is one line `FILE: key.path: message`, all of them in one go.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import re
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agent.config import AgentConfig, CameraConfig, ConfigError, ModelConfig, camera_file, file_problem
from agent.lifecycle.model import model_labels
from pipelines.models import SpecError, check_outputs, probe_outputs, resolve_onnx
from pipelines.urls import mask_url


def _probe(path: Path) -> dict[str, np.ndarray]:
    return probe_outputs(path)  # a name of this module: the config fuzz test stubs it


def check_model(name: str, m: ModelConfig, source: str) -> tuple[list[str], list[str] | None]:
    """(errors, labels) of one model section."""
    key = f"{source}: models.{name}"
    errors: list[str] = []
    labels: list[str] | None = None
    if m.labels is None:
        errors.append(f"{key}.labels: required (the class names, one per line, in output order)")
    else:
        problem = file_problem(m.labels)
        if problem is not None and problem.startswith(("is ", "not ")):  # a directory, a FIFO (would block)
            errors.append(f"{key}.labels: {m.labels}: {problem}")
        else:
            try:
                labels = list(model_labels(name, m))
            except ConfigError as exc:
                errors.append(f"{source}: {exc}")
    if m.engine_file is not None:
        problem = file_problem(m.engine_file)
        if problem is None and m.engine_file.suffix != ".json":
            problem = "not an engine manifest (<key>.json, the plan beside it; edge-agent engines list)"
        if problem is not None:
            errors.append(f"{key}.engine_file: {m.engine_file}: {problem}")
    problem = file_problem(m.onnx)
    if problem is not None:
        errors.append(f"{key}.onnx: {m.onnx}: {problem}")
        return errors, labels
    try:
        outputs = _probe(m.onnx)
    except Exception as exc:  # ONNX Runtime raises many types for a file that is not a model
        errors.append(f"{key}.onnx: {m.onnx}: not a readable ONNX model ({type(exc).__name__}: {exc})"[:300])
        return errors, labels
    if labels:
        try:  # as the agent will serve it: host decoding, or the graph's own if the ONNX is grafted
            check_outputs(m.format, resolve_onnx(name, m.onnx, m.format, labels).adapter(), outputs)
        except SpecError as exc:
            errors.append(f"{key}.{exc.key}: {exc}")
        except ValueError as exc:
            errors.append(f"{key}.format: {m.format}: {exc}")
    return errors, labels


# ---- the host ---------------------------------------------------------------------------------------


def directory_problem(directory: Path) -> str | None:
    """Why `directory` cannot hold this agent's files, or None: it is created (with its parents) and a file
    is written in it, as the engine store does (os.access lies for root). What this made is removed again."""
    made: list[Path] = []
    try:
        if directory.exists() and not directory.is_dir():
            return f"{directory}: exists and is not a directory"
        missing = directory
        while not missing.exists() and missing != missing.parent:
            made.append(missing)
            missing = missing.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{directory}: cannot be created ({exc.strerror or exc})"
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        except OSError as exc:
            return f"{directory}: is not writable ({exc.strerror or exc})"
        os.close(fd)
        os.unlink(probe)
        return None
    except (OSError, ValueError) as exc:  # a path too long, a NUL
        return f"{directory}: unusable ({getattr(exc, 'strerror', None) or exc})"
    finally:
        for path in made:  # deepest first; a folder someone else filled meanwhile stays
            with contextlib.suppress(OSError):
                path.rmdir()


def _own_listener(port: int) -> bool:
    """This process already listens on `port` (a reload: the running agent's /metrics)."""
    try:
        import psutil

        return any(
            c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            for c in psutil.Process().net_connections(kind="inet")
        )
    except Exception:  # psutil refused (no /proc?): assume not ours
        return False


def port_problem(port: int, host: str = "0.0.0.0") -> str | None:
    """Why /metrics could not listen on `host:port`, or None. Tried as prometheus_client's server binds it
    (SO_REUSEADDR: a port in TIME_WAIT is free), then closed again."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            if _own_listener(port):
                return None
            return f"{port} is in use (another process listens on it)"
        if exc.errno == errno.EACCES:
            return f"{port}: permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
        return f"cannot listen on {port} ({exc.strerror or exc})"
    finally:
        sock.close()


def gstreamer_problem() -> str | None:
    """Why OpenCV cannot open a GStreamer `pipeline` here, or None."""
    try:
        import cv2
    except ImportError as exc:
        return f"needs OpenCV (cv2), which is not importable: {exc}"
    info = cv2.getBuildInformation()
    if re.search(r"^\s*GStreamer:\s*YES", info, re.MULTILINE):
        return None
    return (
        f"needs OpenCV built with GStreamer, but this cv2 {cv2.__version__} has none (on a Jetson use "
        "JetPack's system cv2; else give a 'url')"
    )


def gpu_preprocess_problem() -> str | None:
    """Why `preprocess: gpu` cannot run here (it needs cuda-python with NVRTC and a CUDA GPU), or None.
    Imports CUDA only when called, i.e. only for a model that asks for it."""
    try:
        from engines.cuda.buffers import cuda_call, import_cudart

        rt = import_cudart()
        for names in (("cuda.bindings.nvrtc", "cuda.nvrtc"), ("cuda.bindings.driver", "cuda.cuda")):
            problems = []
            for module in names:
                try:
                    importlib.import_module(module)
                    break
                except ImportError as exc:
                    problems.append(f"{module}: {exc}")
            else:
                return "cuda-python is incomplete (" + "; ".join(problems) + ")"
        if not cuda_call(rt, "cudaGetDeviceCount", rt.cudaGetDeviceCount()):
            return "no CUDA GPU is visible"
    except Exception as exc:  # UnavailableError, CudaError (no driver, no device), the bindings' own
        return str(exc) or type(exc).__name__
    return None


def _engine_target(name: str, m: ModelConfig, engine_dir: Path) -> tuple[bool, str | None]:
    """(whether TensorRT serves the model here, why the backend asked for cannot be), as `run` decides
    (agent.lifecycle.serving.engine_target): auto without TensorRT or without a GPU is ONNX Runtime."""
    if m.backend == "onnxruntime":
        return False, None
    try:
        from agent.lifecycle.model import ModelContext
        from agent.lifecycle.serving import OrtOnly, engine_target

        target = engine_target(ModelContext(name, m, engine_dir, 0.4))
    except ConfigError as exc:  # tensorrt or tensorrt_rtx by name, not importable or unable to run here
        return True, str(exc)
    except Exception as exc:  # engine_target turns EngineError into ConfigError; anything else is news
        why = f"models.{name}.backend: {m.backend} cannot be checked here ({type(exc).__name__}: {exc})"
        return True, why[:300]
    return not isinstance(target, OrtOnly), None


def _camera_problems(name: str, cam: CameraConfig, gstreamer: Callable[[], str | None]) -> list[str]:
    key = f"cameras.{name}"
    if cam.pipeline is not None:
        problem = gstreamer()
        return [] if problem is None else [f"{key}.pipeline: {problem}"]
    local = camera_file(cam.url) if cam.url is not None else None
    if local is None:
        return []
    problem = file_problem(Path(local))
    return [] if problem is None else [f"{key}.url: {mask_url(local)}: {problem}"]


def _host_problems(cfg: AgentConfig) -> list[str]:
    """What `run` would find missing on this host, one line each (without the file name)."""
    problems: list[str] = []
    gst: list[str | None] = []

    def gstreamer() -> str | None:  # asked once, for the first pipeline camera
        if not gst:
            gst.append(gstreamer_problem())
        return gst[0]

    for name, cam in cfg.cameras.items():
        if cam.enabled:  # a disabled camera is never opened
            problems += _camera_problems(name, cam, gstreamer)
    gpu: list[str | None] = []
    stores: list[str] = []  # models that keep files in engine_dir
    for name, m in cfg.models.items():
        if m.preprocess == "gpu":
            if not gpu:
                gpu.append(gpu_preprocess_problem())
            if gpu[0] is not None:
                problems.append(f"models.{name}.preprocess: gpu is not available here: {gpu[0]} (or use cpu)")
        tensorrt, problem = _engine_target(name, m, cfg.engine_dir)
        if problem is not None:
            problems.append(problem)
        if tensorrt or m.postprocess == "graph":
            stores.append(name)
        if tensorrt and m.precision in ("int8", "best") and m.calibration.source == "folder":
            folder = m.calibration.folder
            if folder is None:
                problems.append(f"models.{name}.calibration.folder: required when source is 'folder'")
            elif not folder.is_dir():
                why = "is not a directory" if folder.exists() else "no such directory"
                problems.append(f"models.{name}.calibration.folder: {folder}: {why}")
    trt_models = [name for name, m in cfg.models.items() if m.backend != "onnxruntime"]
    if trt_models:  # a pip TensorRT wheel over JetPack's on a Jetson (engines.trt.jetpack)
        from engines.trt.jetpack import tensorrt_wheel_problem

        problem = tensorrt_wheel_problem()
        if problem is not None:
            problems.append(f"models.{trt_models[0]}.backend: {problem}")
    if stores:  # the engine store: TensorRT plans, INT8 calibration, grafted graphs (agent.lifecycle)
        problem = directory_problem(cfg.engine_dir)
        if problem is not None:
            problems.append(f"engine_dir: {problem} (models {', '.join(stores)} keep engines there)")
    port = cfg.telemetry.prometheus_port
    if port is not None:
        problem = port_problem(port)
        if problem is not None:
            problems.append(f"telemetry.prometheus_port: {problem}")
    return problems


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
    try:
        errors += [f"{source}: {line}" for line in _host_problems(cfg)]
    except Exception as exc:  # a check that broke must not hide the others' lines behind a traceback
        errors.append(f"{source}: preflight: a host check failed ({type(exc).__name__}: {exc})"[:300])
    return errors
