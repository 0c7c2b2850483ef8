"""`python -m agent.bench`: `edge-agent bench` where the CLI's dependencies are missing."""

import sys

from agent.bench.run import main

sys.exit(main())
