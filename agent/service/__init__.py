"""The service cluster: what the agent tells systemd and how it runs as a unit.

notify      sd_notify (READY, STATUS, WATCHDOG, EXTEND_TIMEOUT) and the watchdog interval
supervisor  decides READY, WATCHDOG pings and STATUS from the daemon's progress snapshots
journal     journald logging with CAMERA= / MODEL= fields
logs        logging set-up for every entry point: journald under systemd, else one line per record
signals     SIGTERM / SIGINT / SIGHUP into the main loop, no lock taken inside a handler
install     `edge-agent install-service`: service user, /etc/edge-agent, the systemd unit
"""

from agent.service.notify import Notifier, ServiceError, extending, watchdog_interval
from agent.service.signals import SignalInbox
from agent.service.supervisor import ModelProgress, Progress, Supervisor

__all__ = [
    "ModelProgress",
    "Notifier",
    "Progress",
    "ServiceError",
    "SignalInbox",
    "Supervisor",
    "extending",
    "watchdog_interval",
]
