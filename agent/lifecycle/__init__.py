"""The engine lifecycle, top-down: which runtime serves a model, and how its engine is made and swapped in.

    agent.daemon                      wires models, cameras and sinks
      -> lifecycle.manager            per model: open, reload, publish (state: lifecycle.state)
           -> lifecycle.builds        jobs in a child, one per model, frames captured first
           -> lifecycle.swap          load + warm-up + hot swap, refused plans, the store watcher
           -> lifecycle.serving       which runtime serves here (shared with the CLI)
           -> lifecycle.calibration   calibration sets; FrameTap (daemon: frames from its pipeline)
           -> lifecycle.capture       capturing a set: folder, cameras, or the pipeline's frames
           -> lifecycle.job           the child: plan -> per step: gate -> build -> engine gate
                -> lifecycle.gate     FP32 reference vs candidate on held-out frames
                   (lifecycle.candidates: the graphs measured; lifecycle.gate_report: the verdict)
                -> engines.*          plan, precision, fingerprint, compat check, build, store, runtimes
    agent.cli -> lifecycle.commands   check / rebuild / calibrate / validate: the same job and checks

lifecycle.model.ModelContext is what every step knows of a model: resolved from the config once, and
handed to the child as JSON.
"""
