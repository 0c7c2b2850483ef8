"""The engine lifecycle, top-down: which runtime serves a model, and how its engine is made and swapped in.

    agent.runtime / agent.shards      wire models, cameras and sinks; hold one EngineManager per role
      -> lifecycle.manager            per model: open (check), reload, publish; composed by lifecycle.roles
           -> lifecycle.state         the published state (StateBoard: set and publish in order)
           -> lifecycle.builds        the daemon's jobs: one per model, on a thread, frames from the pipeline
           -> lifecycle.swap          Adopter: load, warm-up, hot swap, refused plans (or Announcer)
           -> lifecycle.watch         engines built by other processes, adopted alike
           -> lifecycle.serving       which runtime serves here (shared with the CLI)
           -> lifecycle.calibration   calibration sets; FrameTap (daemon: frames from its pipeline)
           -> lifecycle.capture       capturing a set: folder, cameras, or the pipeline's frames
    lifecycle.runner                  a job, daemon and CLI: lock -> frames -> request -> child -> events
           -> lifecycle.job           the child: plan -> per step: gate -> build -> engine gate
                -> lifecycle.gate     FP32 reference vs candidate on held-out frames
                   (lifecycle.candidates: the graphs measured; lifecycle.gate_report: the verdict)
                -> engines.*          plan, precision, fingerprint, compat check, build, store, runtimes
    agent.cli -> lifecycle.commands   check / rebuild / calibrate / validate: the same runner and checks

lifecycle.model.ModelContext is what every step knows of a model: resolved from the config once, and
handed to the child as JSON.
"""
