"""The pipeline of one process, in the parts that `agent.runtime.local.LocalRuntime` composes:

- protocol:    what a device and its runtime say to each other (Runtime, Outlet, Prepared)
- local:       LocalRuntime, the pipeline of this process as a device's runtime
- cameras:     a running camera's state (CameraRuntime) and its class mask
- wiring:      building and closing model workers (their backends) and camera readers (Pipeline)
- sinks:       where results go: MQTT detections and snapshots, console, telemetry windows, frame taps
- reports:     what the process reports about itself: camera states, telemetry fields, progress
- transaction: a checked config applied in place, all or nothing (ReloadTransaction)
"""
