"""What each stage asks the cluster for, from a file read when the workflow is registered.

    FLYSCALE_RESOURCES=configs/cluster/resources.yaml pyflyte register --image ... workflows/

(configs/cluster/resources.yaml by default, when it exists; the defaults below otherwise). Training asks
per worker process, so its requests scale with FLYSCALE_NPROC_PER_NODE: 4 processes of 1 CPU,
4 GiB and 1 GPU ask for 4 CPUs, 16 GiB and 4 GPUs per node. The classic launcher's replicas run
one process each and ask for one process's share.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from flytekit import Resources
from flytekit.extras.accelerators import GPUAccelerator

from flyscale import settings

ENV = settings.RESOURCES.name
DEFAULT_FILE = Path(__file__).resolve().parents[2] / settings.RESOURCES.default
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti)?$")


def _scaled(quantity: str, n: int, name: str) -> str:
    """A Kubernetes quantity times n ("1.5" x 2 = "3", "4Gi" x 4 = "16Gi")."""
    match = _QUANTITY.match(str(quantity))
    if not match:
        raise ValueError(f"{name}: {quantity!r} is not a Kubernetes quantity such as '2', '500m' or '4Gi'")
    value = float(match.group(1)) * n
    return f"{value:g}{match.group(2) or ''}"


@dataclass(frozen=True)
class StageResources:
    cpu: str = "1"
    mem: str = "2Gi"

    def resources(self) -> Resources:
        return Resources(cpu=_scaled(self.cpu, 1, "cpu"), mem=_scaled(self.mem, 1, "mem"))


@dataclass(frozen=True)
class TrainingResources:
    cpu_per_process: str = "1"
    mem_per_process: str = "2Gi"
    gpu_per_process: int = 0
    accelerator: str = ""  # the node's GPU, as Flyte names it: nvidia-tesla-t4, nvidia-h100, ...
    shared_memory: str = "2Gi"  # /dev/shm for DataLoader workers and gloo; "" for the node's default

    def resources(self, processes: int) -> Resources:
        """What a node (or pod) running `processes` workers asks for."""
        cpu = _scaled(self.cpu_per_process, processes, "training.cpu_per_process")
        mem = _scaled(self.mem_per_process, processes, "training.mem_per_process")
        gpu = self.gpu_per_process * processes
        return Resources(cpu=cpu, mem=mem, gpu=str(gpu) if gpu else None)

    def task_kwargs(self, processes: int) -> dict:
        """@task arguments: requests and limits, the accelerator, the shared memory."""
        res = self.resources(processes)
        kwargs: dict = {"requests": res, "limits": res, "shared_memory": self.shared_memory or None}
        if self.accelerator:
            kwargs["accelerator"] = GPUAccelerator(self.accelerator)
        return kwargs


@dataclass(frozen=True)
class ClusterResources:
    small: StageResources = field(default_factory=StageResources)  # every task but training
    training: TrainingResources = field(default_factory=TrainingResources)

    @classmethod
    def from_dict(cls, raw: dict, source: str) -> ClusterResources:
        known = {"small": StageResources, "training": TrainingResources}
        unknown = set(raw) - set(known)
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {sorted(unknown)}; expected {sorted(known)}")
        sections = {}
        for name, kind in known.items():
            values = raw.get(name) or {}
            fields = {f.name: f.type for f in dataclasses.fields(kind)}
            bad = set(values) - set(fields)
            if bad:
                raise ValueError(f"{source}: {name}.{sorted(bad)[0]} is not a setting; {name} takes {sorted(fields)}")
            if name == "training" and not isinstance(values.get("gpu_per_process", 0), int):
                raise ValueError(
                    f"{source}: training.gpu_per_process must be a whole number, got {values['gpu_per_process']!r}"
                )
            sections[name] = kind(**{k: v if k == "gpu_per_process" else str(v) for k, v in values.items()})
        loaded = cls(**sections)
        loaded.small.resources()  # every quantity parses, or the error names it now
        loaded.training.resources(1)
        return loaded


def load() -> ClusterResources:
    path = settings.RESOURCES.get() if settings.RESOURCES.is_set() else ""
    if path and not Path(path).is_file():
        raise FileNotFoundError(
            f"{ENV}={path}: no such file (it names the cluster resources file; unset it for the defaults)"
        )
    source = Path(path) if path else DEFAULT_FILE
    if not source.is_file():  # in a task's pod: resources were fixed at registration
        return ClusterResources()
    return ClusterResources.from_dict(yaml.safe_load(source.read_text()) or {}, str(source))


CLUSTER = load()
SMALL = CLUSTER.small.resources()
