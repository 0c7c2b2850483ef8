"""The engine lifecycle, top-down: which runtime serves a model, and how its engine is made and swapped in.

    agent.daemon                      wires models, cameras and sinks
      -> lifecycle.manager            per model: state machine, jobs in a child, load + warm-up + swap
           -> lifecycle.serving       which runtime serves here (shared with the CLI)
           -> lifecycle.calibration   frames for the gate and INT8 (daemon: tapped from its pipeline)
           -> lifecycle.job           the child: plan -> per step: gate -> build -> engine gate
                -> lifecycle.gate     FP32 reference vs candidate on held-out frames
                -> engines.*          plan, fingerprint, compat check, build, store, runtimes
    agent.cli -> lifecycle.commands   check / rebuild / calibrate / validate: the same job and checks

lifecycle.model.ModelContext is what every step knows of a model: resolved from the config once, and
handed to the child as JSON.
"""
