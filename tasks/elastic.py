"""Which distributed launcher the training task uses, chosen at registration, never in code.

Locally (`pyflyte run` without --remote) training always runs as `nproc_per_node` torch-elastic
worker processes on this machine. On a cluster the same task becomes a Kubeflow PyTorchJob:

    FLYSCALE_NNODES=2 FLYSCALE_NPROC_PER_NODE=4 pyflyte run --remote workflows/train.py training_pipeline

`FLYSCALE_MAX_RESTARTS` (default 1) is how often torch-elastic restarts the worker group after a
worker dies; the group resumes from the run's last checkpoint. With `FLYSCALE_LAUNCHER=pytorch`,
the task is a classic PyTorchJob of one master and `FLYSCALE_NNODES - 1` worker pods (one process
each) with per-replica resources (`FLYSCALE_REPLICA_CPU`, `FLYSCALE_REPLICA_MEM`,
`FLYSCALE_REPLICA_GPU`). Run locally, that launcher trains in one process.

A multi-node setting run locally would wait for peers that never come (the rendezvous times out
after 15 minutes), so `LocalSafeElastic` runs it on one node instead and says so. It extends
flytekit's task plugin through `execute`, the method flytekit documents for it, and hands the
local run to a single-node twin of the task; it never touches the task's own settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Iterator

from flytekit import Resources
from flytekit.core.task import TaskPlugins
from flytekitplugins.kfpytorch import Elastic, Master, PyTorch, Worker
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

from tasks import exit_codes

log = logging.getLogger(__name__)


@dataclass
class LocalSafeElastic(Elastic):
    """`Elastic`, except that a local run with nnodes > 1 falls back to one node."""


def in_pytorchjob() -> bool:
    """True inside a PyTorchJob pod: the training operator sets PET_NNODES in every one."""
    return os.environ.get("PET_NNODES") is not None


@contextlib.contextmanager
def importable_by_workers(fn) -> Iterator[None]:
    """Keep the folder holding `fn`'s top-level package on sys.path while workers are spawned.

    Spawned workers unpickle the task function by module name (`tasks.train`), and they start
    with the parent's sys.path. `pyflyte run` puts the project root there only while it loads
    the workflow file, so without this a local run's workers cannot import the task's module.
    (In the image the working directory is on PYTHONPATH already, and this changes nothing.)
    """
    top = sys.modules[fn.__module__.split(".")[0]]
    where = os.path.dirname(os.path.dirname(top.__file__) if hasattr(top, "__path__") else top.__file__)
    added = where not in sys.path
    if added:
        sys.path.insert(0, where)
    try:
        yield
    finally:
        if added:
            sys.path.remove(where)


class LocalSafeElasticTask(PytorchElasticFunctionTask):
    def execute(self, **kwargs):
        try:
            with importable_by_workers(self.task_function), transient_faults_retryable():
                if self.min_nodes > 1 and not in_pytorchjob():
                    log.warning(
                        "nnodes=%s applies to remote runs only; running locally on one node with %d workers",
                        self.task_config.nnodes, self.task_config.nproc_per_node,
                    )
                    return self._single_node_twin.execute(**kwargs)
                return super().execute(**kwargs)
        except Exception as exc:
            exit_codes.record(exc)  # for the pod's exit code (PyTorchJob's ExitCode restart policy)
            raise

    def get_default_command(self, settings) -> list[str]:
        """flytekit's command, under tasks.exit_codes: the pod exits 1 for a permanent failure
        and 143 for a retryable one, where pyflyte-execute alone always exits 0."""
        return ["python", "-m", "tasks.exit_codes", *super().get_default_command(settings)]

    @functools.cached_property
    def _single_node_twin(self) -> PytorchElasticFunctionTask:
        """The same function under flytekit's own Elastic plugin, on one node."""
        config = Elastic(**{f.name: getattr(self.task_config, f.name) for f in dataclasses.fields(Elastic)})
        return PytorchElasticFunctionTask(task_config=dataclasses.replace(config, nnodes=1), task_function=self.task_function)


@contextlib.contextmanager
def transient_faults_retryable() -> Iterator[None]:
    """Faults of the machine, not of the code or the data, as FlyteRecoverableException, so that
    Flyte retries the task (which then resumes from its checkpoint).

    flytekit's Elastic task calls a failure retryable only when the worker raised a
    FlyteRecoverableException itself. A worker killed by a signal (SIGKILL from the OOM killer or
    a preempted node, SIGTERM) raised nothing: flytekit wraps torch-elastic's ChildFailedError in
    a FlyteUserRuntimeException, which Flyte does not retry. A rendezvous that times out (peers
    that never came) is transient too.
    """
    from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        yield
    except FlyteUserRuntimeException as exc:
        failure = exc.value if isinstance(exc.value, ChildFailedError) else None
        killed = {rank: f for rank, f in failure.failures.items() if f.exitcode < 0} if failure else {}
        if not killed:
            raise
        named = ", ".join(f"rank {rank} (pid {f.pid}) by {f.signal_name()}" for rank, f in sorted(killed.items()))
        raise FlyteRecoverableException(
            f"training workers were killed: {named}, after the configured worker restarts. A retry resumes "
            f"from the last checkpoint.\n{failure.format_msg()}"
        ) from exc
    except RendezvousError as exc:
        raise FlyteRecoverableException(f"the training workers' rendezvous failed: {exc}. A retry may find its peers") from exc


TaskPlugins.register_pythontask_plugin(LocalSafeElastic, LocalSafeElasticTask)


def _replica_resources() -> Resources:
    gpu = os.environ.get("FLYSCALE_REPLICA_GPU")
    return Resources(
        cpu=os.environ.get("FLYSCALE_REPLICA_CPU", "2"), mem=os.environ.get("FLYSCALE_REPLICA_MEM", "4Gi"), gpu=gpu or None
    )


# The launcher's settings and their defaults: elastic, 1 node, 2 worker processes, and one restart
# of the worker group after a worker dies (it resumes from the last checkpoint).
LAUNCHER_SETTINGS = {
    "FLYSCALE_LAUNCHER": "elastic", "FLYSCALE_NNODES": "1", "FLYSCALE_NPROC_PER_NODE": "2", "FLYSCALE_MAX_RESTARTS": "1",
}


def _setting(name: str) -> str:
    return os.environ.get(name) or LAUNCHER_SETTINGS[name]


def launcher_facts() -> str:
    """The launcher's kind, nodes and processes per node, for the training tasks' cache versions
    (they decide the global batch; how often a dead worker is restarted does not)."""
    return ":".join(f"{name}={_setting(name)}" for name in LAUNCHER_SETTINGS if name != "FLYSCALE_MAX_RESTARTS")


def training_retries() -> int:
    """How often Flyte retries the training task after a retryable failure (FLYSCALE_TRAIN_RETRIES,
    default 2); each retry resumes from the checkpoint the failed attempt saved."""
    retries = int(os.environ.get("FLYSCALE_TRAIN_RETRIES") or 2)
    if retries < 0:
        raise ValueError(f"FLYSCALE_TRAIN_RETRIES must be >= 0, got {retries}")
    return retries


def worker_start_method() -> str:
    """How torch-elastic starts the workers: `fork` with a CPU build of torch, `spawn` with a CUDA one.

    A spawned worker imports torch, flytekit and the task's module again (about 5 s on 2 cores,
    most of a small local run's training task); a forked one starts with them imported. CUDA
    cannot be used in a child forked after its parent touched CUDA, and the parent's process
    (`pyflyte run` runs every task in one) may have, so a CUDA build keeps `spawn`. A forked
    worker inherits its parent's intra-op thread count: `distributed.process_group` applies the
    launcher's OMP_NUM_THREADS, as a spawned worker's torch would at import.
    """
    import torch

    return "spawn" if torch.version.cuda or "fork" not in multiprocessing.get_all_start_methods() else "fork"


def training_launcher() -> LocalSafeElastic | PyTorch:
    """The launcher from FLYSCALE_LAUNCHER (elastic | pytorch), FLYSCALE_NNODES, FLYSCALE_NPROC_PER_NODE."""
    launcher = _setting("FLYSCALE_LAUNCHER")
    nnodes = int(_setting("FLYSCALE_NNODES"))
    nproc = int(_setting("FLYSCALE_NPROC_PER_NODE"))
    restarts = int(_setting("FLYSCALE_MAX_RESTARTS"))
    if nnodes < 1 or nproc < 1:
        raise ValueError(f"FLYSCALE_NNODES and FLYSCALE_NPROC_PER_NODE must be >= 1, got {nnodes} and {nproc}")
    if restarts < 0:
        raise ValueError(f"FLYSCALE_MAX_RESTARTS must be >= 0, got {restarts}")
    if launcher == "pytorch":
        if nnodes < 2:
            raise ValueError("FLYSCALE_LAUNCHER=pytorch needs FLYSCALE_NNODES >= 2 (one master plus workers)")
        resources = _replica_resources()
        return PyTorch(
            master=Master(requests=resources, limits=resources),
            worker=Worker(replicas=nnodes - 1, requests=resources, limits=resources),
            increase_shared_mem=False,
        )
    if launcher != "elastic":
        raise ValueError(f"FLYSCALE_LAUNCHER must be 'elastic' or 'pytorch', got {launcher!r}")
    # Short rendezvous timeouts locally; a cluster may wait for pods to be scheduled.
    timeouts = {"timeout": 900, "join_timeout": 900} if nnodes > 1 else {"timeout": 120, "join_timeout": 120}
    return LocalSafeElastic(
        nnodes=nnodes, nproc_per_node=nproc, rdzv_configs=timeouts, max_restarts=restarts,
        start_method=worker_start_method(),
        monitor_interval=0.1,  # how often the agent looks at its workers (a float to torch; never serialised)
        increase_shared_mem=False,  # the task asks for shared memory itself (@task(shared_memory=True))
    )
