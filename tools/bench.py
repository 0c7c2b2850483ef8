"""Benchmark runner, same as `edge-agent bench`: `python tools/bench.py [--out DIR]`."""

import sys

from agent.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
