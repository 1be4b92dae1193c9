"""Which distributed launcher the training task uses, chosen at registration, never in code.

Locally (`pyflyte run` without --remote) training always runs as `nproc_per_node` torch-elastic
worker processes on this machine. On a cluster the same task becomes a Kubeflow PyTorchJob:

    FLYSCALE_NNODES=2 FLYSCALE_NPROC_PER_NODE=4 pyflyte run --remote workflows/train.py training_pipeline

`FLYSCALE_MAX_RESTARTS` (default 1) is how often torch-elastic restarts the worker group after a
worker dies; the group resumes from the run's last checkpoint. With `FLYSCALE_LAUNCHER=pytorch`,
the task is a classic PyTorchJob of one master and `FLYSCALE_NNODES - 1` worker pods (one process
each), each asking for one worker process's resources (configs/cluster/resources.yaml). Run
locally, that launcher trains in one process.

A multi-node setting run locally would wait for peers that never come (the rendezvous times out
after 15 minutes), so `LocalSafeElastic` runs it on one node instead and says so. It extends
flytekit's task plugin through `execute`, the method flytekit documents for it, and hands the
local run to a single-node twin of the task; it never touches the task's own settings.

What the environment sets (nodes, processes, restarts, retries) is read in `launcher_settings`;
how the task's failures are said, and which are retried, is `worker_failures`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from flytekit.core.task import TaskPlugins
from flytekitplugins.kfpytorch import Elastic, Master, PyTorch, Worker
from flytekitplugins.kfpytorch.task import (
    PytorchElasticFunctionTask,
    PyTorchFunctionTask,
)

from flyscale import settings
from flyscale.cluster import exit_codes, resources
from flyscale.cluster.launcher_settings import in_pytorchjob, local_workers, node_range, processes_per_node
from flyscale.cluster.worker_failures import (
    interruptions_said,
    transient_faults_retryable,
    worker_errors_said_plainly,
)
from flyscale.config import TrainConfig
from flyscale.flyte import heap

log = logging.getLogger(__name__)


@dataclass
class LocalSafeElastic(Elastic):
    """`Elastic`, except that a local run with nnodes > 1 falls back to one node."""


@contextlib.contextmanager
def importable_by_workers(fn) -> Iterator[None]:
    """Keep the folder holding `fn`'s top-level package on sys.path while workers are spawned.

    Spawned workers unpickle the task function by module name (`tasks.train`), and they start
    with the parent's sys.path. `pyflyte run` puts the project root there only while it loads
    the workflow file, so without this a local run's workers cannot import the task's module.
    (In the image the working directory is on PYTHONPATH already, and this changes nothing.)
    """
    top = sys.modules[fn.__module__.split(".")[0]]
    if top.__file__ is None:  # a namespace package: nothing to put on the path
        yield
        return
    where = os.path.dirname(os.path.dirname(top.__file__) if hasattr(top, "__path__") else top.__file__)
    added = where not in sys.path
    if added:
        sys.path.insert(0, where)
    try:
        yield
    finally:
        if added:
            sys.path.remove(where)


class ExitCodeCommand:
    """A training task's container command under flyscale.cluster.exit_codes, so its pod exits by the
    PyTorchJob ExitCode convention (its execute records failures with `exit_codes.recorded`)."""

    def get_default_command(self, settings) -> list[str]:
        return exit_codes.wrapped(super().get_default_command(settings))  # type: ignore[misc]  # a mixin: the task class after it has it


class LocalSafeElasticTask(ExitCodeCommand, PytorchElasticFunctionTask):
    def execute(self, **kwargs):
        # Recorded outermost: the pod's exit code follows the retryable conversion below.
        with (
            exit_codes.recorded(),
            interruptions_said(),
            importable_by_workers(self.task_function),
            transient_faults_retryable(),
            worker_errors_said_plainly(),
        ):
            if in_pytorchjob():
                return super().execute(**kwargs)
            _preload_for_forked_workers()
            nproc = local_workers(kwargs.get("cfg"), self.task_config.nproc_per_node, kwargs.get("workers", 0))
            if self.max_nodes > 1:  # a range "1:4" too: no peers will come
                log.warning(
                    "nnodes=%s applies to remote runs only; running locally on one node with %d workers",
                    self.task_config.nnodes,
                    nproc,
                )
            elif nproc != self.task_config.nproc_per_node:
                fixed = isinstance(kwargs.get("cfg"), TrainConfig) and kwargs["cfg"].workers() is not None
                why = "train.options.mesh asks for" if fixed else "FLYSCALE_NPROC_PER_NODE=auto chose"
                log.info("%s %d workers: running %d locally", why, nproc, nproc)
            else:
                return super().execute(**kwargs)
            return self._single_node_twin(nproc).execute(**kwargs)

    def _single_node_twin(self, nproc: int) -> PytorchElasticFunctionTask:
        """The same function under flytekit's own Elastic plugin, on one node of `nproc` workers
        (made once per worker count)."""
        twins = self.__dict__.setdefault("_twins", {})
        if nproc not in twins:
            config = Elastic(**{f.name: getattr(self.task_config, f.name) for f in dataclasses.fields(Elastic)})
            one_node = dataclasses.replace(
                config, nnodes=1, nproc_per_node=nproc, start_method=worker_start_method(nproc)
            )
            twins[nproc] = PytorchElasticFunctionTask(task_config=one_node, task_function=self.task_function)
        return twins[nproc]


def local_execution() -> bool:
    """True in a local run (`pyflyte run` without --remote); False in a task's pod."""
    from flytekit import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    return state is None or state.is_local_execution()


@dataclass
class ClassicPyTorch(PyTorch):
    """flytekit's `PyTorch` (a PyTorchJob of one master and worker pods), whose pods exit by the
    ExitCode convention too."""


class ClassicPyTorchTask(ExitCodeCommand, PyTorchFunctionTask):
    def execute(self, **kwargs):
        with exit_codes.recorded():
            return super().execute(**kwargs)


TaskPlugins.register_pythontask_plugin(LocalSafeElastic, LocalSafeElasticTask)
TaskPlugins.register_pythontask_plugin(ClassicPyTorch, ClassicPyTorchTask)


def _preload_for_forked_workers() -> None:
    """Import here what every worker imports anyway, so that a forked worker starts with it.

    torch's optimizers import its compiler (torch._dynamo, about a second) at their first step,
    to ask whether they are being compiled; nothing before training needs it. Likewise
    torch.distributed.checkpoint, which every checkpoint and resume needs and the driver does
    not. Imported once here, each forked worker inherits them instead of importing them on its own;
    and the driver's heap is frozen (flyscale/flyte/heap.py), so that no worker's collector walks it."""
    import torch._dynamo
    import torch.distributed.checkpoint  # noqa: F401

    heap.before_fork()


def worker_start_method(nproc_per_node: int) -> str:
    """How torch-elastic starts the workers: `fork` where that is safe, `spawn` otherwise.

    A spawned worker imports torch, flytekit and the task's module again (about 5 s on 2 cores,
    most of a small local run's training task); a forked one starts with them imported. Forking
    is safe only for a worker that runs one thread: GNU OpenMP's thread team does not survive a
    fork, so a child that computes with several threads after its parent did (`pyflyte run`
    runs every task in one process) hangs. Several workers a node run one thread each
    (flytekit's Elastic task sets OMP_NUM_THREADS=1 unless you set it; `process_group` applies
    it to a forked worker, which still has its parent's count). And CUDA cannot be used in a
    child forked after its parent touched it. So: fork with a CPU build of torch, several
    workers and one thread each; spawn otherwise.
    """
    import torch

    one_thread = os.environ.get("OMP_NUM_THREADS", "1") == "1"
    forkable = "fork" in multiprocessing.get_all_start_methods() and not torch.version.cuda
    return "fork" if forkable and nproc_per_node > 1 and one_thread else "spawn"


def training_launcher() -> LocalSafeElastic | ClassicPyTorch:
    """The launcher from FLYSCALE_LAUNCHER (elastic | pytorch), FLYSCALE_NNODES, FLYSCALE_NPROC_PER_NODE."""
    launcher = settings.LAUNCHER.get()
    (fewest, nnodes), nproc = node_range(), processes_per_node()
    restarts = settings.MAX_RESTARTS.integer(0)
    if launcher == "pytorch":
        if fewest != nnodes:
            raise ValueError(
                f"FLYSCALE_NNODES={settings.NNODES.get()!r}: a range of nodes is torch-elastic's; "
                f"FLYSCALE_LAUNCHER=pytorch runs a fixed number of pods"
            )
        if nnodes < 2:
            raise ValueError("FLYSCALE_LAUNCHER=pytorch needs FLYSCALE_NNODES >= 2 (one master plus workers)")
        pod = resources.CLUSTER.training.resources(1)  # one process per pod
        return ClassicPyTorch(
            master=Master(requests=pod, limits=pod),
            worker=Worker(replicas=nnodes - 1, requests=pod, limits=pod),
            increase_shared_mem=False,
        )
    if launcher != "elastic":
        raise ValueError(f"FLYSCALE_LAUNCHER must be 'elastic' or 'pytorch', got {launcher!r}")
    return elastic_launcher(nnodes if fewest == nnodes else f"{fewest}:{nnodes}", nproc, restarts)


def elastic_launcher(nnodes: int | str, nproc: int, restarts: int) -> LocalSafeElastic:
    """torch-elastic on `nnodes` nodes (or a range "MIN:MAX") of `nproc` worker processes,
    restarting them up to `restarts` times."""
    most = int(str(nnodes).rpartition(":")[2])
    # Short rendezvous timeouts locally; a cluster may wait for pods to be scheduled.
    timeouts = {"timeout": 900, "join_timeout": 900} if most > 1 else {"timeout": 120, "join_timeout": 120}
    return LocalSafeElastic(
        nnodes=nnodes,
        nproc_per_node=nproc,
        rdzv_configs=timeouts,
        max_restarts=restarts,
        start_method=worker_start_method(nproc),
        monitor_interval=0.1,  # how often the agent looks at its workers (a float to torch; never serialised)
        increase_shared_mem=False,  # the task asks for its shared memory itself (training.shared_memory)
    )
