"""acquire_engine (agent.fleet.acquire) with real build claims on a real mosquitto; the registry and the build
are fakes (fake_*): their real counterparts (engines.cache, the lifecycle's job) are tested on their own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from fixtures_mqtt import Broker

from agent.config.mqtt import MqttConfig
from agent.fleet.acquire import Acquired, acquire_engine
from agent.fleet.claims import BuildClaims
from engines.cache.errors import CacheRejected, CacheUnavailable

KEY = "trt10.3-orin-sm87-abc123"


@dataclass(frozen=True)
class FakePulled:
    bytes: int


@dataclass
class FakeRegistry:
    """What the devices share: tags -> plan size; what each call did."""

    tags: dict[str, int] = field(default_factory=dict)
    pulls: list[str] = field(default_factory=list)
    pushes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fake_pull(self, device: str) -> Callable[[str], FakePulled | None]:
        def pull(key: str) -> FakePulled | None:
            with self.lock:
                self.pulls.append(device)
                return FakePulled(self.tags[key]) if key in self.tags else None

        return pull

    def fake_push(self, device: str) -> Callable[[str, str], FakePulled | None]:
        def push(key: str, built: str) -> FakePulled | None:
            with self.lock:
                self.pushes.append(device)
                if key in self.tags:
                    return None  # never over an existing tag
                self.tags[key] = len(built)
                return FakePulled(len(built))

        return push


def fake_build(device: str, builds: list[str], seconds: float = 0.0) -> Callable[[str], str]:
    def build(key: str) -> str:
        builds.append(device)
        time.sleep(seconds)  # a build that takes a while: the others must wait, not build
        return f"plan of {key} built by {device}"

    return build


def fake_pull_raising(exc: Exception) -> Callable[[str], None]:
    def pull(key: str) -> None:
        raise exc

    return pull


@pytest.fixture
def claims_for(mqtt_broker: Broker) -> Iterator[Callable[[str], BuildClaims]]:
    made: list[BuildClaims] = []

    def make(device: str) -> BuildClaims:
        cfg = MqttConfig(host="127.0.0.1", port=mqtt_broker.port)
        made.append(BuildClaims(cfg, "edge-agent", device, ttl_s=10.0, settle_s=0.3).open())
        return made[-1]

    yield make
    for c in made:
        c.close()


def run(
    device: str, registry: FakeRegistry, claims: BuildClaims, builds: list[str], **over: object
) -> Acquired:
    lines: list[str] = []
    args: dict = {
        "pull": registry.fake_pull(device),
        "build": fake_build(device, builds),
        "push": registry.fake_push(device),
        "claims": claims,
        "wait_s": 60.0,
        "poll_s": 0.1,
        "log": lines.append,
        **over,
    }
    return acquire_engine(KEY, **args)


def test_a_hit_is_pulled_without_claim_or_build(claims_for: Callable[[str], BuildClaims]) -> None:
    registry, builds = FakeRegistry(tags={KEY: 4096}), []
    got = run("orin-a", registry, claims_for("orin-a"), builds)
    assert (got.origin, got.bytes, got.built, got.pushed) == ("cache", 4096, None, None)
    assert builds == [] and registry.pushes == []
    assert claims_for("orin-observer").holder(KEY) is None  # nobody claimed


@pytest.mark.parametrize("n", [2, 3])
def test_devices_missing_together_build_once_and_the_others_pull(
    claims_for: Callable[[str], BuildClaims], n: int
) -> None:
    registry, builds = FakeRegistry(), []
    devices = [f"orin-{i:02d}" for i in range(n)]
    claims = {d: claims_for(d) for d in devices}
    results: dict[str, Acquired] = {}
    start = threading.Barrier(n)

    def device(d: str) -> None:
        start.wait()
        results[d] = run(d, registry, claims[d], builds, build=fake_build(d, builds, seconds=1.0))

    threads = [threading.Thread(target=device, args=(d,)) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(builds) == 1 and registry.pushes == builds, (builds, registry.pushes)
    builder = builds[0]
    assert results[builder].origin == "built" and results[builder].why == "claimed"
    assert results[builder].pushed is not None and results[builder].bytes == registry.tags[KEY]
    for d in devices:
        if d != builder:
            assert results[d].origin == "cache" and results[d].bytes == registry.tags[KEY], results[d]
            assert results[d].waited_s > 0 and any(builder in line for line in results[d].notes)
    assert claims_for("orin-observer").holder(KEY) is None  # released after the push


def test_a_failed_build_releases_the_claim_and_a_waiter_builds(
    claims_for: Callable[[str], BuildClaims],
) -> None:
    registry, builds = FakeRegistry(), []
    winner_claims, waiter_claims = claims_for("orin-first"), claims_for("orin-second")
    assert winner_claims.claim(KEY)  # the first device holds the key before the second looks
    released = threading.Event()

    def fake_failing_build(key: str) -> str:
        builds.append("orin-first")
        raise RuntimeError("the gate failed")

    def first() -> None:
        # it does what acquire does for a winner (build under the claim, release on failure)
        with pytest.raises(RuntimeError, match="gate failed"):
            run("orin-first", registry, winner_claims, builds, build=fake_failing_build)
        released.set()

    waiting: dict[str, Acquired] = {}
    second = threading.Thread(
        target=lambda: waiting.update(got=run("orin-second", registry, waiter_claims, builds))
    )
    second.start()
    time.sleep(0.5)  # the second is waiting on the first's claim now
    threading.Thread(target=first).start()
    second.join(60)
    assert released.is_set()
    got = waiting["got"]
    assert builds == ["orin-first", "orin-second"] and registry.pushes == ["orin-second"]
    assert (got.origin, got.why) == ("built", "claimed")


def test_a_device_that_waits_too_long_builds_itself(claims_for: Callable[[str], BuildClaims]) -> None:
    registry, builds = FakeRegistry(), []
    assert claims_for("orin-stuck").claim(KEY)  # builds forever, renewing, never pushes
    now = [1000.0]

    def fake_clock() -> float:
        return now[0]

    def fake_sleep(s: float) -> None:
        now[0] += s

    got = run(
        "orin-a",
        registry,
        claims_for("orin-a"),
        builds,
        wait_s=120.0,
        poll_s=5.0,
        clock=fake_clock,
        sleep=fake_sleep,
    )
    assert (got.origin, got.why, builds) == ("built", "waited", ["orin-a"])
    assert got.waited_s == 120.0 and len(registry.pulls) == 1 + 120 // 5
    assert any("orin-stuck builds" in line for line in got.notes)
    assert any(line.startswith("waited 120 s") and "building here" in line for line in got.notes)
    assert registry.pushes == ["orin-a"]  # the tag was free: it serves the others from now on


def test_registry_unavailable_builds_here_says_it_once_and_pushes_nothing(
    claims_for: Callable[[str], BuildClaims],
) -> None:
    registry, builds, lines = FakeRegistry(), [], []
    down = CacheUnavailable("registry 127.0.0.1:5000: connection refused")
    got = run(
        "orin-a", registry, claims_for("orin-a"), builds, pull=fake_pull_raising(down), log=lines.append
    )
    assert (got.origin, got.why, builds, registry.pushes) == ("built", "unavailable", ["orin-a"], [])
    why = "registry 127.0.0.1:5000: connection refused"
    assert [line for line in lines if "unavailable" in line] == [
        f"engine cache is unavailable (pull {KEY}: {why}); building here"
    ]
    assert claims_for("orin-observer").holder(KEY) is None  # no claim: nobody could pull what we build


def test_registry_going_down_while_waiting_builds_here(claims_for: Callable[[str], BuildClaims]) -> None:
    registry, builds, lines = FakeRegistry(), [], []
    assert claims_for("orin-builder").claim(KEY)
    calls = [0]

    def fake_pull(key: str) -> None:
        calls[0] += 1
        if calls[0] > 2:
            raise CacheUnavailable("registry 127.0.0.1:5000: timed out after 10 s")
        return None

    got = run("orin-a", registry, claims_for("orin-a"), builds, pull=fake_pull, log=lines.append)
    assert (got.origin, got.why, builds, registry.pushes) == ("built", "unavailable", ["orin-a"], [])
    assert len([line for line in lines if "unavailable" in line]) == 1


def test_a_rejected_plan_is_built_over_locally_never_pushed_over(
    claims_for: Callable[[str], BuildClaims],
) -> None:
    registry, builds, lines = FakeRegistry(tags={KEY: 10}), [], []
    bad = CacheRejected(f"{KEY}: plan sha256 mismatch (tampered in the registry)")
    got = run("orin-a", registry, claims_for("orin-a"), builds, pull=fake_pull_raising(bad), log=lines.append)
    assert (got.origin, got.why, builds) == ("built", "rejected", ["orin-a"])
    assert registry.pushes == [] and got.pushed is None and registry.tags == {KEY: 10}
    assert len(lines) == 1 and "must not be loaded" in lines[0] and "sha256 mismatch" in lines[0]


def test_a_refused_push_keeps_the_engine(claims_for: Callable[[str], BuildClaims]) -> None:
    registry, builds, lines = FakeRegistry(), [], []

    def fake_push(key: str, built: str) -> None:
        raise CacheRejected("the registry refused the upload: 403")

    got = run("orin-a", registry, claims_for("orin-a"), builds, push=fake_push, log=lines.append)
    assert (got.origin, got.why, got.pushed, got.built) == (
        "built",
        "claimed",
        None,
        f"plan of {KEY} built by orin-a",
    )
    assert lines == [f"engine cache refused the push of {KEY} (the registry refused the upload: 403)"]
    assert claims_for("orin-observer").holder(KEY) is None


def test_claims_unavailable_builds_here_and_still_pushes(mqtt_broker_stopped: Broker) -> None:
    registry, builds, lines = FakeRegistry(), [], []
    cfg = MqttConfig(host="127.0.0.1", port=mqtt_broker_stopped.port)
    claims = BuildClaims(cfg, "edge-agent", "orin-a", timeout_s=0.5)
    try:
        got = run("orin-a", registry, claims, builds, log=lines.append)
    finally:
        claims.close()
    assert (got.origin, got.why, builds, registry.pushes) == ("built", "no claims", ["orin-a"], ["orin-a"])
    assert (
        len(lines) == 1
        and f"127.0.0.1:{mqtt_broker_stopped.port}" in lines[0]
        and "without agreement" in lines[0]
    )
