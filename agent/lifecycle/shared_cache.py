"""The fleet's engine cache in front of the engine job (issue 38; docs/DESIGN.md "Fleet: engine cache, build
claims, rollouts").

    shared = SharedCache(cache, trust, signer, claims, wait_s=1800)    # agent.lifecycle.cache_setup makes it
    result = shared.acquire(ctx, api, fingerprint, store, "fp32", force=False, build=run_the_job)

Before the job builds, the engine of the key the job would keep is pulled: digest, sha256 and signature
checked by the client (engines.cache), the manifest checked against this device as a stored one is
(engines.build.compat: the same key, no difference), the gate passed where the precision has one; it is
then written into the engine store like a built one (origin `cache`) and takes the path a built engine
takes (loaded where it runs; TensorRT-RTX without a GPU: `fallback`, ONNX Runtime serves). A miss:
one device of the fleet builds (agent.fleet.acquire over the build claims) and pushes its engine once its
gate passed (`engines.push`); the others pull it. The registry down or slow: built here, said once until it
answers again. A plan the cache holds that fails verification: built here, never pushed over.

The key is known before the job where the requested precision does not depend on this device's frames
(fp32, fp16: the engine of the plan's first step), or after a gate on record (agent.lifecycle.job's
resolved_settings); an INT8 engine calibrated on this device's frames has its own key, so the job just
builds and pushes it. A forced build (an operator's, or the rebuild of a plan TensorRT refused) never
pulls; it is pushed like any, and a push never overwrites a tag.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.fleet.acquire import Acquired, acquire_engine
from agent.lifecycle.calibration import CalibrationError
from agent.lifecycle.cancel import JobCancelled
from agent.lifecycle.job import JobResult, resolved_settings
from agent.lifecycle.model import ModelContext
from agent.telemetry.engine_cache import ENGINE_CACHE
from engines.build.builder import timing_cache_path
from engines.build.compat import BuildSpec, build_spec, check, differences
from engines.cache.errors import CacheRejected, CacheUnavailable
from engines.cache.results import Pulled, Pushed
from engines.cache.signing import PlanSigner, PlanTrust
from engines.cache.stale import remove_stale
from engines.errors import EngineError, ManifestError
from engines.fingerprint import Fingerprint
from engines.manifest import Manifest, load_manifest
from engines.plan import Capabilities, plan_steps
from engines.precision import Precision
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.store.fsutil import atomic_write_bytes

if TYPE_CHECKING:  # the client loads oras and requests (~0.5 s at start): only agents with a cache need it
    from engines.cache.client import EngineCache

# The daemon's log names the engine manager for every line of its lifecycle.
log = logging.getLogger("agent.lifecycle.manager")

POLL_S = 5.0  # while another device builds: a pull this often
UNAVAILABLE = "engine cache is unavailable"  # acquire's line when the registry is down or slow
# acquire's lines that say something is wrong (a rejected plan, a refused push, no claims): warnings.
_WARNINGS = ("engine cache holds", "engine cache refused", "build claims unavailable", "build claim ")


class Claims(Protocol):
    def claim(self, key: str) -> bool: ...
    def holder(self, key: str) -> str | None: ...
    def release(self, key: str) -> None: ...


class NoClaims:
    """Without MQTT there is nobody to agree with: every device builds what it misses."""

    def claim(self, key: str) -> bool:
        return True

    def holder(self, key: str) -> str | None:
        return None

    def release(self, key: str) -> None:
        return None


@dataclass(frozen=True)
class _Job:
    """One acquisition: the model, where its engine goes, the key it should have."""

    ctx: ModelContext
    store: EngineStore
    spec: BuildSpec
    precision: Precision


class SharedCache:
    """The cache as one configuration section describes it (agent.lifecycle.cache_setup). Thread-safe as
    its parts are: every build of a model runs under the model's lock, the counters have their own."""

    def __init__(
        self,
        cache: EngineCache,
        trust: PlanTrust,
        signer: PlanSigner | None,
        claims: Claims,
        *,
        device: str,
        wait_s: float,
        poll_s: float = POLL_S,
    ) -> None:
        self.cache, self.trust, self.signer, self.claims = cache, trust, signer, claims
        self.device, self.wait_s, self.poll_s = device, wait_s, poll_s
        self._down = False  # the registry did not answer: said once, until it does again
        self.closed = threading.Event()  # set by close(): a wait under this section ends (SectionReplaced)

    def close(self) -> None:
        """This section is out (a reload replaced it, or the agent stops): waits end, claims released."""
        self.closed.set()
        if hasattr(self.claims, "close"):
            self.claims.close()

    def acquire(
        self,
        ctx: ModelContext,
        caps: Capabilities,
        fp: Fingerprint,
        store: EngineStore,
        precision: Precision,
        force: bool,
        build: Callable[[], JobResult],
        sleep: Callable[[float], None] = time.sleep,
    ) -> JobResult:
        """The job's result: pulled (origin `cache`) or built by `build` (the job) and pushed. `sleep`:
        between two pulls while another device builds; what it raises (agent.lifecycle.cancel) ends it."""
        expected = None if force else expected_spec(ctx, caps, fp, precision)
        if expected is None or _fits(store, ctx.name, *expected, fp):
            # A forced build, no key before the gate, or the engine is here already (the job says so).
            result = build()
            self._push_after(ctx, store, fp, result)
            return result
        spec = expected[1]
        job = _Job(ctx, store, spec, precision)
        try:
            got: Acquired[JobResult] = acquire_engine(
                spec.key,
                pull=lambda key: self._pull(job),
                build=lambda key: build(),
                push=lambda key, result: self._push(ctx, store, spec.fingerprint, result),
                claims=self.claims,
                wait_s=self.wait_s,
                poll_s=self.poll_s,
                log=self._say,
                sleep=sleep,
            )
        except JobCancelled as exc:  # nothing pulled or built: the store is as it was
            log.info("model %s: engine %s: stopped waiting for the engine cache: %s", ctx.name, spec.key, exc)
            raise
        self._counted(got)
        if got.origin == "cache":
            return pulled_result(job, got.pulled)
        assert got.built is not None  # build() returned
        return got.built

    # ---- pull ------------------------------------------------------------------------------------
    def _pull(self, job: _Job) -> Pulled | None:
        """Pull the key into the store; None for a miss. CacheRejected where what came is unfit here."""
        try:
            remove_stale(job.store.root, (".cache-pull-*",))  # what a pull killed mid-way left
            tmp = Path(tempfile.mkdtemp(prefix=".cache-pull-", dir=job.store.root))
        except OSError as exc:  # this device's disk, not the cache: build (and say why once)
            why = exc.strerror or exc
            raise CacheUnavailable(f"no room to stage a pull in {job.store.root}: {why}") from None
        try:
            pulled = self.cache.pull(job.spec.key, tmp / "engine", self.trust, compatible(job.spec))
            self._answered()
            if pulled is None:
                ENGINE_CACHE.count(misses=1)
                return None
            install(job.store, job.ctx.name, job.spec, pulled)
            return pulled
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- push ------------------------------------------------------------------------------------
    def _push(
        self, ctx: ModelContext, store: EngineStore, fp: Fingerprint, result: JobResult
    ) -> Pushed | None:
        """Push what the job built, once its gate passed (`engines.push`); None when it is not pushed.
        `fp`: the build's fingerprint (its timing cache goes along)."""
        if self.signer is None or not pushable(result) or result.key is None:
            return None
        manifest = store.manifest(ctx.name, result.key)
        if manifest is None or manifest.path is None:
            return None
        plan = store.plan_path_for(ctx.name, manifest)
        timing: Path | None = timing_cache_path(store, fp)
        timing = timing if timing is not None and timing.is_file() else None
        try:
            pushed = self.cache.push(result.key, plan, manifest.path, timing, self.signer, self.device)
        except (ValueError, OSError) as exc:  # a manifest without its key, a file gone: ours stays here
            log.warning("model %s: engine %s not pushed: %s", ctx.name, result.key, exc)
            return None
        self._answered()
        if pushed is not None:
            ENGINE_CACHE.count(pushes=1, pushed_bytes=pushed.bytes, push_s=pushed.seconds)
            what = f"engine {result.key} pushed to the engine cache ({pushed.bytes} bytes)"
            log.info("model %s: %s", ctx.name, what)
        return pushed

    def _push_after(self, ctx: ModelContext, store: EngineStore, fp: Fingerprint, result: JobResult) -> None:
        """A build outside acquire (forced, or no key before the gate): pushed all the same, never raising."""
        if self.signer is None or not pushable(result):
            return
        engine = ctx.cfg.engine
        try:
            self._push(ctx, store, fp.for_build(engine.dla_core, engine.target_compute_capability), result)
        except CacheUnavailable as exc:  # a push is a favour to the fleet: the engine is here either way
            self._say(f"{UNAVAILABLE} (push {result.key}: {exc.reason}); the engine stays here")
        except CacheRejected as exc:
            self._say(f"engine cache refused the push of {result.key} ({exc.reason})")

    # ---- what is said and counted --------------------------------------------------------------------
    def _say(self, line: str) -> None:
        if line.startswith(UNAVAILABLE):
            if self._down:
                log.debug("%s", line)
                return
            self._down = True
            log.warning("%s (said once until it answers again)", line)
            return
        warn = line.startswith(_WARNINGS)
        log.log(logging.WARNING if warn else logging.INFO, "%s", line)

    def _answered(self) -> None:
        if self._down:
            self._down = False
            log.info("engine cache answers again")

    def _counted(self, got: Acquired[JobResult]) -> None:
        if got.origin == "cache":
            ENGINE_CACHE.count(hits=1, pulled_bytes=got.bytes, pull_s=got.pull_s)
            return
        ENGINE_CACHE.count(pull_s=got.pull_s)
        if got.why == "rejected":
            ENGINE_CACHE.count(rejected=1)
        elif got.why == "unavailable":
            ENGINE_CACHE.count(unavailable=1)


def expected_spec(
    ctx: ModelContext, caps: Capabilities, fp: Fingerprint, precision: Precision
) -> tuple[BuildSettings, BuildSpec] | None:
    """The build the job would keep (its settings and spec), where it is known before the job (module
    docstring), else None."""
    first = plan_steps(precision, caps)[0]
    try:
        if first.precision != "int8":
            settings: BuildSettings | None = ctx.build_settings(first.precision)
        elif precision == ctx.cfg.precision:
            settings = resolved_settings(ctx, caps)[0]  # type: ignore[arg-type]
        else:
            settings = None
        return None if settings is None else (settings, build_spec(settings, fp))
    except (EngineError, CalibrationError):  # an ONNX that cannot be read, ...: the job says so
        return None


def _fits(store: EngineStore, model: str, settings: BuildSettings, spec: BuildSpec, fp: Fingerprint) -> bool:
    """The store holds an engine that fits already (compat.check; a store it cannot read: no)."""
    try:
        return check(store, model, settings, fp).ok
    except EngineError:
        return False


def compatible(spec: BuildSpec) -> Callable[[Path], None]:
    """The compat check of a pulled manifest: this device's and this configuration's, as for a stored one."""

    def check_manifest(path: Path) -> None:
        try:
            m = load_manifest(path)
        except ManifestError as exc:
            raise CacheRejected(f"its manifest cannot be read: {exc}") from None
        if m.recorded_key != spec.key:
            raise CacheRejected(f"its manifest is of engine {m.recorded_key}, not {spec.key}")
        reasons = differences(m, spec)
        if reasons:
            raise CacheRejected(f"it does not fit this device: {'; '.join(reasons)}")
        if spec.precision != "fp32" and not (m.validation or {}).get("passed"):
            raise CacheRejected(f"its {spec.precision} engine did not pass its accuracy gate")

    return check_manifest


def install(store: EngineStore, model: str, spec: BuildSpec, pulled: Pulled) -> Manifest:
    """The pulled engine into the store (the caller holds the model's lock): the store checks the plan's
    sha256 against the manifest. The timing cache seeds this device's when it has none."""
    m = load_manifest(pulled.manifest)
    try:
        plan = pulled.plan.read_bytes()
        stored = store.write(model, spec.key, plan, Manifest(m.fingerprint, m.build, m.validation, None))
    except (EngineError, OSError) as exc:
        raise CacheRejected(f"the engine store refused it: {exc}") from None
    if pulled.timing_cache is not None:
        local = timing_cache_path(store, spec.fingerprint)
        with contextlib.suppress(OSError):  # only a cache: the engine is stored
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(local, pulled.timing_cache.read_bytes())
    return stored


def pushable(result: JobResult) -> bool:
    """A build of this job whose gate passed (or needed none): what the fleet may load."""
    if not (result.ok and result.built and result.key):
        return False
    return result.validation is None or bool(result.validation.get("passed"))


def pulled_result(job: _Job, pulled: Any) -> JobResult:
    """The job's result for an engine pulled from the cache."""
    m = job.store.manifest(job.ctx.name, job.spec.key)
    validation = m.validation if m is not None else None
    state = None if validation is None else {k: validation[k] for k in _STATE_VALIDATION if k in validation}
    return JobResult(
        True,
        job.precision,
        job.spec.precision,  # type: ignore[arg-type]
        built=False,
        key=job.spec.key,
        plan=str(job.store.plan_path_for(job.ctx.name, m)) if m is not None else None,
        message=(
            f"engine {job.spec.key} of model {job.ctx.name!r} pulled from the engine cache ({pulled.bytes} "
            f"bytes in {pulled.seconds:.1f} s; built by {pulled.builder}, signed by {pulled.key_id})"
        ),
        validation=validation,
        state_validation=state,
        origin="cache",
    )


_STATE_VALIDATION = ("metric", "value", "threshold", "passed", "precision", "requested")

