"""The training launcher as the environment sets it (FLYSCALE_LAUNCHER, FLYSCALE_NNODES,
FLYSCALE_NPROC_PER_NODE, FLYSCALE_MAX_RESTARTS, FLYSCALE_TRAIN_RETRIES), and what follows from it:
the nodes, the processes per node and the world size training is planned for, the training tasks'
resources, environment and cache facts, how often Flyte retries them, and whether this process
runs in a PyTorchJob's pod. Building the launcher itself is launchers.py's.
"""

from __future__ import annotations

import os

from flyscale import settings
from flyscale.cluster import resources
from flyscale.config import TrainConfig


def in_pytorchjob() -> bool:
    """True inside a PyTorchJob pod: the training operator sets PET_NNODES in every one."""
    return os.environ.get("PET_NNODES") is not None


def local_workers(cfg: object, registered: int, chosen: object = 0) -> int:
    """How many worker processes a local run starts: the number a training config fixes (a hybrid
    mesh), else the number `auto` chose (`chosen`, the training task's `workers` input; 0: none),
    else the launcher's processes per node."""
    fixed = cfg.workers() if isinstance(cfg, TrainConfig) else None
    return fixed or (chosen if isinstance(chosen, int) else 0) or registered


# What `FLYSCALE_NPROC_PER_NODE=auto` (the default) registers: the worker group the preflight
# times against one process. Locally training then runs on the faster; a cluster keeps this.
AUTO_WORKERS = 2


def workers_auto() -> bool:
    """Whether the processes per node are `auto` (the default): chosen by measurement in a local run."""
    return settings.NPROC_PER_NODE.get() == "auto"


def processes_per_node() -> int:
    """The launcher's processes per node: FLYSCALE_NPROC_PER_NODE, or AUTO_WORKERS for `auto`."""
    return AUTO_WORKERS if workers_auto() else settings.NPROC_PER_NODE.integer(1)


def training_resources() -> dict:
    """The training tasks' requests, limits, accelerator and shared memory, from the cluster
    resources file: a worker process's share times the processes per node (a classic
    PyTorchJob's pods run one process each)."""
    processes = 1 if settings.LAUNCHER.get() == "pytorch" else processes_per_node()
    return resources.CLUSTER.training.task_kwargs(processes)


# The launcher's settings: elastic, 1 node, 2 worker processes, and one restart of the worker group
# after a worker dies (it resumes from the last checkpoint), unless the environment says otherwise.
LAUNCHER_SETTINGS = (settings.LAUNCHER, settings.NNODES, settings.NPROC_PER_NODE, settings.MAX_RESTARTS)


def launcher_facts() -> str:
    """The launcher's kind, nodes and processes per node, for the training tasks' cache versions
    (they decide the global batch; how often a dead worker is restarted does not)."""
    return ":".join(f"{s.name}={s.get()}" for s in LAUNCHER_SETTINGS if s is not settings.MAX_RESTARTS)


def node_range() -> tuple[int, int]:
    """(fewest, most) nodes from FLYSCALE_NNODES: "N", or "MIN:MAX" for an elastic job that keeps
    training on fewer nodes than it asked for (torch-elastic's `--nnodes MIN:MAX`)."""
    text = settings.NNODES.get()
    if ":" not in text:
        n = settings.NNODES.integer(1)
        return n, n
    low, _, high = text.partition(":")
    try:
        fewest, most = int(low), int(high)
    except ValueError:
        raise ValueError(f"FLYSCALE_NNODES must be a whole number or a range MIN:MAX, got {text!r}") from None
    if not 1 <= fewest <= most:
        raise ValueError(f"FLYSCALE_NNODES={text!r}: a range needs 1 <= MIN <= MAX")
    return fewest, most


def planned_world_size(cfg: TrainConfig | None = None, local: bool = False) -> int:
    """How many worker processes the configured launcher trains with on a cluster (a classic
    PyTorchJob: one a pod; elastic: nodes times processes per node, the most of a range), or in
    a `local` run (one node: as many as `cfg` fixes, else the processes per node)."""
    nproc = processes_per_node()
    if local:
        return 1 if settings.LAUNCHER.get() == "pytorch" else local_workers(cfg, nproc)
    nnodes = node_range()[1]
    return nnodes if settings.LAUNCHER.get() == "pytorch" else nnodes * nproc


def launcher_environment() -> dict[str, str]:
    """The launcher's settings as registered, for the training tasks' environment: a pod imports
    the task module again, and must build the same launcher (nodes, processes, restarts) that was
    registered, not the defaults."""
    return {s.name: s.get() for s in LAUNCHER_SETTINGS}


def training_retries() -> int:
    """How often Flyte retries the training task after a retryable failure (FLYSCALE_TRAIN_RETRIES,
    default 2); each retry resumes from the checkpoint the failed attempt saved."""
    return settings.TRAIN_RETRIES.integer(0)
