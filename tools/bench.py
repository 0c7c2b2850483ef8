"""Benchmark runner: `python tools/bench.py [--out DIR]` == `edge-agent bench`. Writes bench.json + bench.png."""

import sys

from agent.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
