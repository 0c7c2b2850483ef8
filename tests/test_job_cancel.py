"""agent.lifecycle.cancel: a job's wait for another device's build ends when the job is killed, when the agent
stops and when its engines section is closed (the real agent: tests/test_engine_cache_agent_wait.py). The
claims and the pull stand in for a broker where another device holds the claim and a registry that misses."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from agent.fleet.acquire import acquire_engine
from agent.lifecycle.cancel import JobCancel, JobCancelled, SectionReplaced


class FakeClaims:
    """Another device holds every key and never pushes."""

    def claim(self, key: str) -> bool:
        return False

    def holder(self, key: str) -> str | None:
        return "other"

    def release(self, key: str) -> None:
        raise AssertionError("a waiter holds no claim")


def wait_for_other(cancel: JobCancel, closed: threading.Event | None, end: Any) -> BaseException:
    """acquire_engine waiting (wait_s 1800) until `end()` runs on another thread; what it raised."""
    built: list[str] = []
    timer = threading.Timer(0.3, end)
    timer.start()
    try:
        with pytest.raises(JobCancelled) as info:
            acquire_engine(
                "k1",
                pull=lambda key: None,
                build=lambda key: built.append(key),
                push=lambda key, b: None,
                claims=FakeClaims(),
                wait_s=1800,
                poll_s=60,
                log=lambda line: None,
                sleep=cancel.sleeper(closed),
            )
    finally:
        timer.cancel()
    assert built == []  # nothing built after a cancelled wait
    return info.value


def test_killed_stopped_and_a_closed_section_each_end_the_wait() -> None:
    stop = threading.Event()
    killed = JobCancel(stop)
    assert "reloaded away" in str(wait_for_other(killed, None, killed.kill))

    stopping = JobCancel(stop)
    assert "stopping" in str(wait_for_other(stopping, None, stop.set))

    closed = threading.Event()
    replaced = wait_for_other(JobCancel(threading.Event()), closed, closed.set)
    assert isinstance(replaced, SectionReplaced)


def test_check_leaves_the_stop_to_the_runner_when_asked() -> None:
    stop = threading.Event()
    stop.set()
    cancel = JobCancel(stop)
    cancel.check(None, stop=False)  # the runner's own `stopped` result follows
    with pytest.raises(JobCancelled, match="stopping"):
        cancel.check(None)
