"""`bench --sections fleet-cache`: N agents of one device kind on one machine (default 8: the same
compatibility key, TensorRT-RTX building real plans on the CPU ahead of time, each agent its own device_id
and engine_dir) on one mosquitto, the model's engine built with an empty shared cache (`engines.cache` on a
fresh docker-registry) and, in the same run, without one (N independent builds).

Each run starts the N agents at once and waits for every device's `engines/{model}` state to hold a plan
(`ready`, or `fallback` where no GPU can run it: ONNX Runtime serves and the plan is built or pulled); a
device's figure is the seconds from the start of the agents to that state, its `origin` (built / cache)
says how the plan came. Reported: builds and pulls counted from the origins, the time until all N serve
and its ratio to the independent run, the bytes the registry served (its access log) and stored, the
manifests pushed, each device's telemetry `engine_cache` counters (hits, pushes, bytes, build and pull
seconds) and the claims seen on `_fleet/builds/...`. On one machine the N independent builds compete for
its cores, so the wall-time ratio favours the cache more than a fleet of N machines would (there each
builds on its own hardware): `fleet_seconds` (build + pull seconds summed over the devices) is what the
cache saves anywhere.

The model is the bundled NanoDet at fp32 (--fleet-precision): an RTX build of it on this CPU takes about a
second (TensorRT-RTX defers kernel choice to the device), far from the 10-30 min of a Jetson build, so the
ratio measured here is the cache's overhead at its worst; the count of builds is the target.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.bench.args import BenchOptions
from agent.bench.deploy_rig import mosquitto
from agent.bench.fleet_rig import FleetListener, registry, registry_traffic, start_agents, stop_agents

MODEL, PREFIX, KEY_ID = "detector", "fleetbench", "fleet"
COUNTED = ("builds", "hits", "misses", "pushes", "pulled_bytes", "pushed_bytes", "build_s", "pull_s")
SERVED = ("ready", "fallback")  # the plan is there: loaded, or ONNX Runtime serves where it cannot run
TIMEOUT_S = 600.0


def agent_config(work: Path, i: int, opts: BenchOptions, mqtt_port: int, cache: str | None,
                 keys: tuple[Path, Path]) -> dict[str, Any]:
    """Device `{kind}-{i}`: the model on TensorRT-RTX, no camera (the build is what is measured)."""
    device = f"kind-a-{i}"
    cfg: dict[str, Any] = {
        "device_id": device,
        "engine_dir": str(work / device / "engines"),
        "models": {
            MODEL: {
                "onnx": str(opts.model),
                "labels": str(opts.labels),
                "format": opts.format,
                "backend": "tensorrt_rtx",
                "precision": opts.fleet_precision,
            }
        },
        "cameras": {},
        "mqtt": {"host": "127.0.0.1", "port": mqtt_port, "prefix": PREFIX},
        "telemetry": {"interval_s": 2},
    }
    if cache is not None:
        cfg["engines"] = {
            "cache": cache,
            "push": True,
            "signing_key": str(keys[0]),
            "signing_key_id": KEY_ID,
            "trusted_keys": {KEY_ID: str(keys[1])},
        }
    return cfg


def served(states: list[tuple[float, dict[str, Any]]]) -> tuple[float, dict[str, Any]] | None:
    """The first state of a device that holds a plan (ready or fallback with a plan_sha256)."""
    return next(((t, s) for t, s in states if s.get("state") in SERVED and s.get("plan_sha256")), None)


def _device_row(t0: float, device: str, states: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """serving_s: from the agents' start to the plan; first_state_s: to the device's first engine state
    (the process up and its engine wanted: start-up, which the cache does not change, is before it)."""
    t, s = served(states) or (float("nan"), {})
    keep = ("state", "origin", "key", "plan_sha256", "build_s")
    first = states[0][0] if states else float("nan")
    return {"device": device, "serving_s": round(t - t0, 2), "first_state_s": round(first - t0, 2),
            **{k: s[k] for k in keep if k in s}}


def _claims(listener: FleetListener) -> dict[str, Any]:
    """Build claims seen on `_fleet/builds/{key}/{device}`: devices that claimed (non-empty payload)."""
    devices = sorted({t.rsplit("/", 1)[-1] for _, t, p in listener.fleet if "/_fleet/builds/" in t and p})
    return {"claimed_by": devices, "messages": sum("/_fleet/builds/" in t for _, t, _ in listener.fleet)}


def _counted(listener: FleetListener, devices: list[str], agents: list[Any]) -> None:
    """Until each device's telemetry counts its engine (a build or a hit): its next period at most."""
    def counted(d: str) -> bool:
        c = listener.counters(d)
        return bool((c.get("builds") or 0) + (c.get("hits") or 0))

    listener.wait(lambda: all(counted(d) for d in devices), 30, "the engine in every agent's telemetry",
                  agents)


def one_run(work: Path, opts: BenchOptions, n: int, cached: bool, keys: tuple[Path, Path]) -> dict[str, Any]:
    """N agents from cold (empty engine dirs; with `cached` an empty registry): each device's row."""
    import yaml

    work.mkdir(parents=True)
    devices = [f"kind-a-{i}" for i in range(1, n + 1)]
    with contextlib.ExitStack() as stack:  # everything started is stopped, whatever fails
        broker = mosquitto(work)
        stack.callback(broker.stop)
        store = registry(work) if cached else None
        if store is not None:
            stack.callback(store.stop)
        cache = f"oci://127.0.0.1:{store.port}/bench/engines" if store else None
        listener = FleetListener(broker.port, PREFIX)
        stack.callback(listener.close)
        configs = [work / f"{d}.yaml" for d in devices]
        for i, path in enumerate(configs, 1):
            path.write_text(yaml.safe_dump(agent_config(work, i, opts, broker.port, cache, keys)))
        load_start = [round(x, 2) for x in os.getloadavg()]  # a machine shared with other work says so
        t0 = time.monotonic()
        agents = start_agents(configs, work / "logs")
        stack.callback(stop_agents, agents)
        listener.wait(lambda: all(served(listener.engine_states(d)) for d in devices), TIMEOUT_S,
                      f"{n} agents' engines ({'shared cache' if cached else 'independent'})", agents)
        rows = [_device_row(t0, d, listener.engine_states(d)) for d in devices]
        claims = _claims(listener)
        _counted(listener, devices, agents)
        for row in rows:
            row["telemetry"] = listener.counters(row["device"])
    run: dict[str, Any] = {"mode": "shared cache" if cached else "independent builds", "devices": rows}
    run["all_serving_s"] = max(r["serving_s"] for r in rows)
    # From the first device wanting the engine to the last serving one: the agents' start-up left out.
    run["engine_window_s"] = round(run["all_serving_s"] - min(r["first_state_s"] for r in rows), 2)
    run["load_avg"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    run["origins"] = {o: sum(r.get("origin", "unknown") == o for r in rows) for o in
                      sorted({r.get("origin", "unknown") for r in rows})}
    run["plans"] = len({r.get("plan_sha256") for r in rows})
    run["agents_counted"] = {k: round(sum(r["telemetry"].get(k) or 0 for r in rows), 3) for k in COUNTED}
    if store is not None:
        run["registry"] = registry_traffic(work / "registry.log", work / "registry")
        run["claims"] = claims
    return run


def fleet_cache_section(opts: BenchOptions) -> dict[str, Any]:
    from agent.deploy.signing import generate_keys

    n = opts.fleet_agents or 8
    with tempfile.TemporaryDirectory(prefix="bench-fleet-cache-") as tmp:
        work = Path(tmp)
        keys = generate_keys(work / "keys", KEY_ID)
        independent = one_run(work / "independent", opts, n, False, keys)
        shared = one_run(work / "cached", opts, n, True, keys)
    builds = [r["build_s"] for r in independent["devices"] if "build_s" in r]
    return {
        "agents": n,
        "model": opts.model.name,
        "backend": "tensorrt_rtx (ahead of time, on the CPU)",
        "precision": opts.fleet_precision,
        "choice": f"{opts.model.name} {opts.fleet_precision}: one RTX build here takes "
        f"{min(builds, default=float('nan')):.1f}-{max(builds, default=float('nan')):.1f} s with {n} at once",
        "independent": independent,
        "cached": shared,
        "builds": shared["origins"].get("built", 0),
        "pulls": shared["origins"].get("cache", 0),
        "ratio_all_serving": round(shared["all_serving_s"] / max(independent["all_serving_s"], 1e-6), 3),
        "ratio_engine_window": round(
            shared["engine_window_s"] / max(independent["engine_window_s"], 1e-6), 3),
        # What the fleet spent making the engine (on N machines the wall time is one build either way;
        # the cache saves the other N-1 builds): build seconds, plus pull seconds with the cache.
        "fleet_seconds": {
            "independent": independent["agents_counted"]["build_s"],
            "cached": round(shared["agents_counted"]["build_s"] + shared["agents_counted"]["pull_s"], 3),
        },
    }


def fleet_cache_summary(section: dict[str, Any]) -> str:
    ind, sh = section["independent"], section["cached"]
    reg, fs = sh.get("registry") or {}, section["fleet_seconds"]
    return (
        f"fleet cache, {section['agents']} agents ({section['choice']}): {section['builds']} build(s) + "
        f"{section['pulls']} pull(s) with the shared cache, all serving in {sh['all_serving_s']:.1f} s vs "
        f"{ind['all_serving_s']:.1f} s for {section['agents']} independent builds (ratio "
        f"{section['ratio_all_serving']:.2f}; from the first engine wanted {sh['engine_window_s']:.1f} vs "
        f"{ind['engine_window_s']:.1f} s, ratio {section['ratio_engine_window']:.2f}); build + pull "
        f"seconds of the fleet {fs['cached']:.1f} vs {fs['independent']:.1f} s; registry served "
        f"{reg.get('bytes_pulled', 0) / 1e6:.1f} MB, stored {reg.get('bytes_stored', 0) / 1e6:.1f} MB "
        f"({reg.get('manifests_pushed', 0)} push); load average {sh['load_avg']['start'][0]:g} at the start"
    )
