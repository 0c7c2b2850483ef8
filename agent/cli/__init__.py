"""`edge-agent` command line, one module per command group (the work itself lives in the packages named).

main       main(): the exit codes (0 success, 1 check/gate failed, 2 usage or runtime error)
parser     build_parser(): every group's subcommands
serve      demo, run, check-config                    (agent.cli.daemon, agent.shards, agent.preflight)
lifecycle  check, rebuild, calibrate, validate, profile (agent.lifecycle)
install    install-service                            (agent.service.install)
fleet      fleet status                               (agent.mqtt.fleet)
bench      bench                                      (agent.bench)
engines/   build, engines list|show|rollback|prune    (engines.store, agent.lifecycle.standalone)
argtypes   argparse types for numbers; stdout: a reader that left (`edge-agent ... | head`)
"""

from agent.cli.main import main
from agent.cli.parser import build_parser
from agent.cli.serve import demo_config, demo_device_id

__all__ = ["build_parser", "demo_config", "demo_device_id", "main"]
