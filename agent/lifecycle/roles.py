"""What one process does with engines: a value the engine manager is composed from.

    EngineManager(cfg, publish, swap, version)                          # DEVICE: serves and builds
    EngineManager(..., role=ShardRole(uplink.request_rebuild))          # serves; the supervisor builds
    EngineManager(..., role=SupervisorRole(gpu=1, build_gate=lock))     # builds and gates; serves nothing

A pipeline shard (agent.shards) serves plans and hands every rebuild to the supervisor; the supervisor
builds and gates but serves nothing (it loads no plan and opens no ONNX Runtime session: each shard's
watcher swaps in what it built). With GPUs of several models, the supervisor runs one manager per GPU
model: fingerprints of GPU `gpu` (NVML / nvidia-smi numbering), builds on it, and `build_gate` makes the
managers' jobs run one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from engines.precision import Precision

# rebuild(name, force, precision, reasons) -> started: where a shard sends its rebuilds.
Delegate = Callable[[str, bool, "Precision | None", "list[str] | None"], bool]


@dataclass(frozen=True)
class DeviceRole:
    """One process serves and builds (a device without shards)."""


@dataclass(frozen=True)
class ShardRole:
    """A pipeline shard: serves what the supervisor builds; `delegate` takes its rebuilds."""

    delegate: Delegate


@dataclass(frozen=True)
class SupervisorRole:
    """The supervisor of shards: checks, builds and gates on GPU `gpu`; serves nothing."""

    gpu: int | None = None
    build_gate: threading.Lock | None = None  # shared by the managers of several GPU models

    def job_env(self) -> dict[str, str] | None:
        """The job child's environment additions: the build runs on GPU `gpu` only."""
        if self.gpu is None:
            return None
        return {"CUDA_VISIBLE_DEVICES": str(self.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


Role = DeviceRole | ShardRole | SupervisorRole
DEVICE = DeviceRole()
