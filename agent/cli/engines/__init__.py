"""Engine commands without agent.yaml: `edge-agent build`, `edge-agent engines list|show|rollback|prune`.

    edge-agent build --onnx M [--precision fp32|fp16|int8|best] [--shapes NAME:DIMS[/OPT/MAX]] [--calib DIR]
                     [--out DIR] [--backend tensorrt|tensorrt_rtx]          (agent.lifecycle.standalone)
    edge-agent engines list     [--dir DIR | -c agent.yaml] [--model M] [--json]
    edge-agent engines show     MODEL [KEY] [--previous] [--json]
    edge-agent engines rollback MODEL [KEY] [--wait S]
    edge-agent engines prune    [--model M] [--key K] [--dry-run] [--wait S]

The store is `--dir DIR`, or the `engine_dir` of `-c agent.yaml`, or ./engines (where `build` puts
engines by default). Every bad input is one line naming the path: a store that does not exist, a
directory that is no engine store, an unknown model or key, nothing to roll back to. rollback and prune
write under the model's build lock (`--wait S` for it; refused at once, naming the holder, otherwise).
A running daemon's engine watcher notices a rollback (the key's manifest is replaced) and swaps the
plan in when that key is the engine its configuration asks for.
Exit codes: 0 done, 2 usage or store error.

    parsers  the two parsers; store  which store, model, key, the build lock, one-line errors
    table    list's rows and table, show's description; actions  list, show, rollback, prune
    build    `edge-agent build`
"""
