"""The report's one-paragraph summary: the real model's rate on this machine first, the agent's own costs,
then the simulated engine's figures, each labelled simulated (bench.json's keys are unchanged)."""

from __future__ import annotations

from typing import Any


def summary(report: dict[str, Any]) -> str:
    """One paragraph: what the real model does on this machine first, then the agent's own costs, then
    the figures of the simulated engine (replayed outputs at a fixed time per batch), labelled as such."""
    parts = []
    if "fps_sequential" in report:
        infer = report["stages_ms"]["infer"]["p50"]
        cpus = (report.get("machine") or {}).get("cpus")
        on = f"ONNX Runtime on this machine's CPU ({cpus} cores)" if cpus else "ONNX Runtime on this CPU"
        parts.append(
            f"{report['model']} with {on}: {report['fps_sequential']} fps one frame at a time "
            f"(infer p50 {infer} ms)."
        )
    simulated = (report.get("engine") or {}).get("kind") == "simulated"
    if not simulated:
        parts += _sweep(report)
        parts += [_isolation(iso) for iso in report.get("isolation") or []]
    for run in report.get("decode_alone") or []:
        parts.append(
            f" {run['streams']} streams decoded alone ({run['decoder'].upper()}, {run['shards']} process"
            f"{'es' if run['shards'] > 1 else ''}, unpaced): {run['decoded_fps']} frames/s."
        )
    for run in report.get("readers") or []:
        fps, up = run["camera_fps"], run["startup"]
        parts.append(
            f" {run['streams']} camera readers alone ({report['options']['decoder'].upper()} decoding): "
            f"{fps['min']}-{fps['max']} fps each (nominal {report['options']['fps']:g}), all streaming "
            f"{up['all_streaming_s']} s after start, {run['cpu_ms_per_frame']} ms CPU per frame."
        )
    if "overhead_ms" in report:
        o = report["overhead_ms"]
        each = ", ".join(
            f"{k}: {v['per_frame']['p50']} ms p50 (pre+post+publish {v['sum']['p50']} ms)"
            for k, v in o.items()
        )
        parts.append(f" Agent overhead per frame, inference replayed, one frame at a time: {each}.")
    if "tracking" in report:
        from agent.bench.tracking import summary as tracking_summary  # needs the config's pydantic

        parts.append(" " + tracking_summary(report["tracking"]))
    if simulated:
        parts += [" " + p.strip() for p in _sweep(report)]
        parts += [" Simulated engine:" + _isolation(iso) for iso in report.get("isolation") or []]
    return "".join(parts).strip()


def _sweep(report: dict[str, Any]) -> list[str]:
    """The sweep's setup, then its largest point (most streams, largest batch)."""
    eng = report.get("engine")
    runs = report.get("runs") or []
    if not (runs and eng):
        return []
    simulated = eng["kind"] == "simulated"
    what = (
        f"Simulated engine, not the model's speed here ({report['model']} outputs recorded once, replayed "
        f"at {eng['ms_per_batch']:g} ms per batch, {eng['slots']} slot{'s' if eng['slots'] > 1 else ''})"
        if simulated
        else "ONNX Runtime on this CPU"
    )
    opts = report["options"]
    src = "RTSP" if opts["rtsp"] else ("decoded by camera readers" if opts["decode"] else "decoded once")
    if opts["decode"] or opts["rtsp"]:
        src += f", {opts.get('decoder', 'cpu').upper()} decoding"
    # RTSP streams are whatever the server sends; the clip then only fed the recorded engine outputs.
    feed = f"{opts['rtsp']}" if opts["rtsp"] else f"{report['clip']} at {report['resolution']}"
    post = ", decode + NMS in the model" if opts.get("postprocess") == "graph" else ""
    parts = [
        f"{what}, {feed} ({src}) at {opts['fps']:g} fps per stream, "
        f"{opts['preprocess'].upper()} preprocessing{post}, max age {opts['max_age_ms']:g} ms."
    ]
    best = max(runs, key=lambda r: (r["streams"], r["batch"]))
    parts.append((" Simulated:" if simulated else "") + _point(best))
    grew = _growth(best)
    if grew:
        parts.append(" " + grew)
    if best.get("camera_fps"):
        up = best["startup"]
        parts.append(
            f" Each camera delivered {best['camera_fps']['min']}-{best['camera_fps']['max']} fps; all "
            f"{up['cameras']} were streaming {up['all_streaming_s']} s after start."
        )
    return parts


def _point(best: dict[str, Any]) -> str:
    lat = best["latency_ms"]
    line = (
        f" {best['streams']} streams, batch <= {best['batch']}: "
        f"offered {best['offered_fps']:.1f} frames/s, "
        f"processed {best['processed_fps']:.1f} ({100 * (best['processed_ratio'] or 0):.1f} %), "
        f"frame age p50 {lat['p50']} / p95 {lat['p95']} / p99 {lat['p99']} ms, mean batch "
        f"{best['mean_batch']}, agent CPU {best['cpu_ms_per_frame']} ms per frame"
    )
    if best.get("engine_busy") is not None:
        line += f", engine busy {100 * best['engine_busy']:.0f} %"
    if best.get("shards"):
        line += f", {len(best['shards'])} shard processes"
    if best.get("vs_decode_alone") is not None:
        line += f", {best['vs_decode_alone']:.2f}x the decoders alone on the same streams"
    if best.get("vs_bare_loop") is not None:
        line += f", {best['vs_bare_loop']:.2f}x the bare ONNX Runtime loop"
    return line + "."


def _isolation(iso: dict[str, Any]) -> str:
    ctl, alone = iso["vs_control"], iso["vs_without"]
    p99 = [iso[v]["latency_ms"]["p99"] for v in ("without", "control", "flapping")]
    return (
        f" Isolation, {iso['streams']} steady cameras beside {iso['flap']} whose source drops them "
        f"every {iso['flap_every_s']:g} s ({iso['flap_reconnects']} reconnects in {iso['rounds']} "
        f"round{'s' if iso['rounds'] > 1 else ''}, medians): against {iso['flap']} "
        f"that stay up, steady frames processed {100 * (ctl['processed_change'] or 0):+.2f} %, "
        f"frame age p99 {ctl['age_p99_delta_ms']:+} ms; against none, "
        f"{100 * (alone['processed_change'] or 0):+.2f} % "
        f"and {alone['age_p99_delta_ms']:+} ms (p99 alone / control / flapping: {p99[0]} / {p99[1]} / "
        f"{p99[2]} ms)."
    )


def _growth(run: dict[str, Any]) -> str:
    tl = [w for w in run.get("timeline", []) if w.get("age_p95_ms") is not None]
    if len(tl) < 3:
        return ""
    first, last = tl[0], tl[-1]
    own = (last["rss_mb"] - last["records_mb"]) - (first["rss_mb"] - first["records_mb"])
    return (
        f"Over {last['t_s']:g} s: RSS {first['rss_mb']} -> {last['rss_mb']} MB ({own:+.1f} MB without the "
        f"bench's own per-frame records), frame age p95 {first['age_p95_ms']} -> {last['age_p95_ms']} ms "
        f"(first -> last window of {tl[0]['t_s']:g} s)."
    )
