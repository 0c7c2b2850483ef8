"""A config in one line, as check-config prints it."""

from __future__ import annotations

from agent.config.schema import AgentConfig


def counted(cfg: AgentConfig) -> str:
    """'1 model(s), 3 camera(s), 1 disabled': a disabled camera is not opened, so it is counted apart."""
    disabled = sum(1 for cam in cfg.cameras.values() if not cam.enabled)
    text = f"{len(cfg.models)} model(s), {len(cfg.cameras) - disabled} camera(s)"
    return text + (f", {disabled} disabled" if disabled else "")
