"""`edge-agent bench`: the whole pipeline under load (see agent/bench/run.py for the sections).

Kept light: the CLI imports agent.bench.args to build its parser without loading the benchmark.

- run: the entry point (`run_bench`, `run_from_args`, `python -m agent.bench`) and the report;
- args: the options; sequential: one frame at a time (stages, overhead); sweep: streams x batch;
- load: one measured run of N streams into a worker; usage: where its CPU went, what the cameras did;
- streams: the streams (looped clip, camera readers); engine: the engine a run uses; workload: what
  the overhead and sweep sections run (input, adapter, labels, recorded outputs, frames);
- shards: a sweep point over N processes, decode alone; isolation: the flapping-camera comparison;
- summary, plot, stats: the report's paragraph, bench.png, percentiles;
- tracking, track_eval: the tracking section and the MOT metrics on synthetic scenes.
"""
