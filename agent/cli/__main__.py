"""`python -m agent.cli ...`: the same as `edge-agent ...`."""

import sys

from agent.cli.main import main

sys.exit(main())
