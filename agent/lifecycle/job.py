"""The precision job: one engine of one model, from a plan of steps, each gated, built and gated again.

    request = JobRequest(ctx, "best", force=False, lock_wait_s=0)
    handle = start_job(request, on_event)        # the child process: `python -m agent.lifecycle.job`
    result = JobResult.from_event(handle.wait())

The daemon and the CLI run every build through this child (fp32 too), handing it a JSON request with
the resolved model (ModelContext): the child never reads the config file. It reads the calibration set
the parent stored (the daemon from its running pipeline, the CLI from the cameras or a folder) and
follows engines.plan.plan_steps from the requested precision down:

    step -> graph gate on ONNX Runtime (not fp32 when fp32 was asked for) -> build (engines.build.builder)
         -> where the engine executes here: gate the engine itself
A step failing any of these gives way to the next; a folded INT8 step runs only when the unfolded build
failed. The gate report (which steps were tried, why they failed) goes next to the calibration set and
into the engine manifest's `validation`.

One job per model at a time, gate and build alike: the model's build lock (engines.store.lock) is held for the
whole job. The parent (CLI or daemon) normally takes it before it captures frames and hands it down
(`lock_fd`, inherited with pass_fds: parent and child hold it together until both are done); a request
without one makes the child take it itself, waiting `lock_wait_s`. Progress events cover the gate too:
the FP32 reference and the candidate frame by frame, INT8 calibration batch by batch.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from agent import __version__
from agent.config import ConfigError
from agent.lifecycle.calibration import (
    CalibrationError,
    CalibrationSet,
    calibration_batches,
    load_calibration_set,
    model_adapter,
)
from agent.lifecycle.candidates import cached_candidate
from agent.lifecycle.gate import Gate
from agent.lifecycle.gate_report import GateEntry, GateReport, read_report, write_report
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import engine_runs_here
from engines.build.builder import BuildResult, build
from engines.buildproc import (
    ChildProcess,
    Event,
    Progress,
    Result,
    die_with_parent,
    failure,
    json_lines_stdout,
    start_child,
)
from engines.errors import EngineError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.plan import Step, needs_gate, plan_steps
from engines.precision import Built, Precision, parse_precision
from engines.runtimes.base import BackendError
from engines.runtimes.tensorrt import TensorRTBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.store.lock import process_command
from engines.trt import TrtApi, import_trt

log = logging.getLogger(__name__)
Emit = Callable[[Event], None]


@dataclass(frozen=True)
class JobRequest:
    model: ModelContext
    precision: Precision  # requested
    force: bool = False
    lock_wait_s: float | None = 0.0  # the model's build lock: 0 = fail at once if held, None = forever
    agent_version: str = __version__
    lock_fd: int | None = None  # the parent holds the model's build lock and handed it down on this fd

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": self.model.to_json()}

    @classmethod
    def from_json(cls, d: Any) -> JobRequest:
        """Raises ConfigError naming the request field."""
        if not isinstance(d, dict):
            raise ConfigError("job request: not a JSON object")
        try:
            wait = d.get("lock_wait_s", 0.0)
            fd = d.get("lock_fd")
            return cls(
                ModelContext.from_json(d["model"]),
                parse_precision(d["precision"], "job request: precision"),
                bool(d.get("force", False)),
                None if wait is None else float(wait),
                str(d.get("agent_version", "unknown")),
                None if fd is None else int(fd),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"job request: {exc}") from None


@dataclass
class JobResult:
    ok: bool
    requested: Precision | None = None  # None: a failure before the job knew it
    precision: Built | None = None  # of the engine kept
    built: bool = False  # False: an engine fitting the request was already there
    key: str | None = None
    plan: str | None = None
    build_s: float = 0.0
    message: str = ""
    reasons: list[str] = field(default_factory=list)  # why a build was needed
    validation: dict[str, Any] | None = None  # the manifest's
    state_validation: dict[str, Any] | None = None  # the MQTT engine state's
    tried: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    error_type: str | None = None
    origin: str = "built"  # of the engine kept: built | store (up to date already) | cache (pulled)

    def to_event(self) -> Result:
        return Result(asdict(self))

    @classmethod
    def from_event(cls, ev: Result) -> JobResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in ev.fields.items() if k in names})

    @classmethod
    def failed(cls, requested: Precision, error: str, error_type: str) -> JobResult:
        return cls(False, requested, error=error, error_type=error_type)


# ---- what a step builds --------------------------------------------------------------------------


def step_settings(
    ctx: ModelContext, step: Step, cset: CalibrationSet | None, method: str | None
) -> BuildSettings:
    """Build settings of a step; INT8 names its calibration (and its Q/DQ graph where that is the route).

    Never makes a derived model: the gate made it (CalibrationError when it is missing)."""
    settings = ctx.build_settings(step.precision)
    if step.precision != "int8":
        return settings
    assert cset is not None
    method = method or ctx.cfg.calibration.method
    record = {"method": method, "samples": len(cset.calibration_paths), "data_id": cset.id}
    if step.calibrator:
        return replace(settings, calibration=record)  # TensorRT's calibrator reads the same frames
    qdq = cached_candidate(ctx, step, cset, method)
    if qdq is None:
        raise CalibrationError(f"model {ctx.name}: the {step.label} graph is missing; run the gate again")
    return replace(settings, qdq_onnx=qdq, calibration=record)


def resolved_settings(ctx: ModelContext, api: TrtApi) -> tuple[BuildSettings | None, GateReport | None, str]:
    """Settings of the engine the last job chose for the configured precision (read-only: `check` and
    daemon start never quantise or convert). (None, None, why) when the job has to run first."""
    requested = ctx.cfg.precision
    steps = plan_steps(requested, api)
    if not needs_gate(steps):
        return ctx.build_settings("fp32"), None, ""
    try:
        cset = load_calibration_set(ctx)
    except CalibrationError:
        return (
            None,
            None,
            f"precision {requested} needs the accuracy gate, and there is no calibration set yet",
        )
    report = read_report(ctx, requested)
    if report is None or report.calibration_id != cset.id:
        return None, None, f"precision {requested} not validated on the current calibration set yet"
    chosen = report.precision if report.passed else "fp32"
    kept = [s for s in steps if s.precision == chosen and s.folded == report.folded]
    if not kept:
        return (
            None,
            None,
            f"precision {requested}: the last gate kept {chosen}, which this TensorRT cannot build",
        )
    step = kept[0]
    try:
        return step_settings(ctx, step, cset, report.method), report, ""
    except CalibrationError as exc:
        return None, None, str(exc)


# ---- the job -------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What one job has in hand while it walks its steps."""

    req: JobRequest
    api: TrtApi
    fp: Fingerprint
    store: EngineStore
    emit: Emit
    cset: CalibrationSet | None = None
    gate: Gate | None = None
    tried: list[GateEntry] = field(default_factory=list)

    @property
    def ctx(self) -> ModelContext:
        return self.req.model

    def progress(self, phase: str, step: int, total: int) -> None:
        self.emit(Progress(phase, step, total))

    def build(self, step: Step) -> BuildResult:
        batches = None
        if step.calibrator:
            assert self.cset is not None
            batches = functools.partial(calibration_batches, self.cset, model_adapter(self.ctx))
        method = self.gate.method if self.gate else None
        return build(
            self.store,
            self.ctx.name,
            step_settings(self.ctx, step, self.cset, method),
            fingerprint=self.fp,
            api=self.api,
            force=self.req.force,
            on_progress=self.progress,
            agent_version=self.req.agent_version,
            calibration_batches=batches,
            locked=True,  # run_job holds the model's lock for the whole job
        )

    def engine_gate(self, step: Step, key: str) -> GateEntry | None:
        """Gate the built engine itself where it executes; None where it cannot (the graph gate stands).

        Written to the TensorRT docs, not run here: no GPU with TensorRT is available to this project."""
        if self.gate is None or not engine_runs_here(self.fp):
            return None
        engine = TensorRTBackend(
            self.store, self.ctx.name, key, api=self.api, fingerprint=self.fp, contexts=self.ctx.cfg.streams
        )
        try:
            engine.load()
            return self.gate.evaluate(step, backend=engine)
        except BackendError as exc:
            log.warning(
                "model %s: engine %s not evaluated here (%s); the graph gate stands", self.ctx.name, key, exc
            )
            return None
        finally:
            engine.close()


def run_job(req: JobRequest, emit: Emit) -> JobResult:
    """Walk the plan under the model's build lock (the parent's, handed down, or taken here); returns the
    result (never raises for expected failures: they are in `error`)."""
    ctx, requested = req.model, req.precision
    try:
        store = EngineStore(ctx.engine_dir)
        if req.lock_fd is not None:
            lock = store.inherited_lock(ctx.name, req.lock_fd)
        else:
            lock = store.lock(ctx.name, wait_s=req.lock_wait_s, command=job_command(ctx.name, requested))
        with lock:
            api = import_trt(ctx.trt_flavor)
            fp = probe_fingerprint(api, target_compute_capability=ctx.cfg.engine.target_compute_capability)
            run = _Run(req, api, fp, store, emit)
            steps = plan_steps(requested, api)
            if needs_gate(steps):
                run.cset = load_calibration_set(ctx)  # stored by the parent
                run.gate = Gate(ctx, run.cset, progress=run.progress)
            return _walk(run, steps)
    except (EngineError, CalibrationError, ConfigError, OSError, ValueError) as exc:
        return JobResult.failed(requested, f"model {ctx.name!r}: {exc}", type(exc).__name__)


def job_command(model: str, precision: Precision) -> str:
    """What the holder of a model's lock says it does: this process's command line and the job."""
    return f"{process_command()} [engine job: model {model}, precision {precision}]"


def _walk(run: _Run, steps: list[Step]) -> JobResult:
    ctx, requested, gate = run.ctx, run.req.precision, run.gate
    previous_build_failed = False
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if step.only_if_build_failed and not previous_build_failed:
            continue
        previous_build_failed = False
        if gate is not None:
            # The step as one phase around its graph gate's (reference, convert/calibrate, candidate).
            run.progress(f"accuracy gate {step.label}", 0, 1)
            entry = gate.evaluate(step)
            run.progress(f"accuracy gate {step.label}", 1, 1)
            run.tried.append(entry)
            if not entry.passed and not last:
                continue
        try:
            result = run.build(step)
        except EngineError as exc:
            if last:
                raise
            log.warning("model %s: %s engine build failed (%s); next step", ctx.name, step.label, exc)
            run.tried.append(
                GateEntry(
                    step.precision, False, f"{step.label}: engine build failed: {exc}", folded=step.folded
                )
            )
            previous_build_failed = True
            continue
        engine_entry = run.engine_gate(step, result.key)
        if engine_entry is not None:
            run.tried.append(engine_entry)
            if not engine_entry.passed and not last:
                continue
        return _finish(run, step, result)
    raise EngineError(f"model {ctx.name!r}: no step of precision {requested} could be tried")


def _finish(run: _Run, step: Step, result: BuildResult) -> JobResult:
    ctx, gate = run.ctx, run.gate
    validation = state = None
    if gate is not None:
        assert run.cset is not None
        # The report describes the engine kept: its last measurement (the engine's where it ran).
        kept = [t for t in run.tried if t.precision == step.precision and t.folded == step.folded]
        report = GateReport.decide(gate, run.req.precision, run.tried, kept[-1])
        write_report(run.cset, report)
        validation, state = report.validation(), report.state()
        run.store.set_validation(ctx.name, result.key, validation)  # run_job holds the model's lock
    return JobResult(
        True,
        run.req.precision,
        step.precision,
        result.built,
        result.key,
        str(result.plan_path),
        round(result.build_s, 3),
        result.message,
        result.reasons,
        validation,
        state,
        [asdict(t) for t in run.tried],
        origin="built" if result.built else "store",
    )


# ---- the child process ---------------------------------------------------------------------------


def start_job(
    request: JobRequest, on_event: Callable[[Event], None] | None, env: dict[str, str] | None = None
) -> ChildProcess:
    """`env`: added to the child's environment (a build for one GPU of several: CUDA_VISIBLE_DEVICES).
    A request with `lock_fd` hands that descriptor (the model's build lock, held) down to the child."""
    fds = () if request.lock_fd is None else (request.lock_fd,)
    argv = [sys.executable, "-m", "agent.lifecycle.job"]
    return start_child(argv, request.to_json(), on_event, env, pass_fds=fds)


def main() -> int:
    die_with_parent()
    emit = json_lines_stdout()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("engines.trt").setLevel(logging.ERROR)
    try:
        request = JobRequest.from_json(json.loads(sys.stdin.read()))
    except (ValueError, ConfigError) as exc:
        emit(failure(f"bad job request on stdin: {exc}", "ConfigError"))
        return 2
    result = run_job(request, emit)
    emit(result.to_event())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
