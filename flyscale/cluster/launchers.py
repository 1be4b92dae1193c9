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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
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
from flyscale.config import TrainConfig
from flyscale.errors import RunInterrupted, UserError, verbose
from flyscale.train.interrupt import read_note

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


@dataclass
class ClassicPyTorch(PyTorch):
    """flytekit's `PyTorch` (a PyTorchJob of one master and worker pods), whose pods exit by the
    ExitCode convention too."""


class ClassicPyTorchTask(ExitCodeCommand, PyTorchFunctionTask):
    def execute(self, **kwargs):
        with exit_codes.recorded():
            return super().execute(**kwargs)


@contextlib.contextmanager
def worker_errors_said_plainly() -> Iterator[None]:
    """In a local run, a worker's own error (bad config or data, a diverged loss) as the one
    message it is, not torch-elastic's report of every worker's traceback; `pyflyte -v` or
    FLYSCALE_VERBOSE=1 keeps the report. (In a pod, Flyte reads the error document: unchanged.)"""
    from flytekit.exceptions.user import FlyteUserRuntimeException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if in_pytorchjob() or verbose():
        yield
        return
    elastic = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = elastic.level
    elastic.setLevel(logging.CRITICAL)  # it logs each failed worker's traceback as the worker ends
    try:
        yield
    except FlyteUserRuntimeException as exc:
        failure = exc.value if isinstance(exc.value, ChildFailedError) else None
        if failure is None:
            raise
        rank, first = failure.get_first_failure()
        message = first.message.get("message", "") if isinstance(first.message, dict) else str(first.message)
        if not message or first.exitcode < 0:  # killed by a signal: transient_faults_retryable says so
            raise
        raise UserError(
            f"training failed on rank {rank}: {message.strip()}\n(the workers' tracebacks: "
            f"pyflyte -v run ..., or {settings.VERBOSE.name}=1)"
        ) from exc
    finally:
        elastic.setLevel(level)


class _AgentSignalSaidOnce(logging.Filter):
    """flytekit logs torch-elastic's agent stopping on a signal with the agent's traceback; the
    interruption is said once, as the run's last line (`interruptions_said`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Elastic launch agent process terminating"):
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def interruptions_said() -> Iterator[None]:
    """In a local run, a Ctrl-C (or SIGTERM) during training as the one line it is: the step the
    workers stopped at together, after their checkpoint, and that the same command resumes; the
    command then exits 128 + the signal (130 for Ctrl-C). Without this the user sees torch-elastic's
    agent's traceback, ending in an empty IgnoreOutputs.

    The workers' main rank notes where it stopped in the file this names in FLYSCALE_INTERRUPT_NOTE
    (flyscale/train/interrupt.py). In a pod, Flyte reads the error document: unchanged."""
    if in_pytorchjob():
        yield
        return
    fd, note = tempfile.mkstemp(prefix="flyscale-interrupt-", suffix=".json")
    os.close(fd)
    name, before = settings.INTERRUPT_NOTE.name, os.environ.get(settings.INTERRUPT_NOTE.name)
    os.environ[name] = note  # the workers, forked or spawned, start with this environment
    quiet = _AgentSignalSaidOnce()
    flytekit_log = logging.getLogger("flytekit")
    flytekit_log.addFilter(quiet)
    try:
        yield
    except Exception as exc:
        signum = exit_codes.signal_of(exc)
        if not signum:
            raise
        said = read_note(note)
        message = (
            said.sentence()
            if said is not None
            else f"interrupted ({signal.Signals(signum).name}) where the training workers could not stop at a step "
            f"together (before their first step, or after their last): the same command trains again, from the "
            f"newest checkpoint there is"
        )
        raise RunInterrupted(message, 128 + signum) from exc
    finally:
        flytekit_log.removeFilter(quiet)
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        with contextlib.suppress(OSError):
            os.unlink(note)


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
    from flytekit.exceptions.user import (
        FlyteRecoverableException,
        FlyteUserRuntimeException,
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        yield
    except FlyteUserRuntimeException as exc:
        failure = exc.value if isinstance(exc.value, ChildFailedError) else None
        killed = {rank: f for rank, f in failure.failures.items() if f.exitcode < 0} if failure else {}
        if failure is None or not killed:
            raise
        named = ", ".join(f"rank {rank} (pid {f.pid}) by {f.signal_name()}" for rank, f in sorted(killed.items()))
        raise FlyteRecoverableException(
            f"training workers were killed: {named}, after the configured worker restarts. A retry resumes "
            f"from the last checkpoint.\n{failure.format_msg()}"
        ) from exc
    except RendezvousError as exc:
        raise FlyteRecoverableException(
            f"the training workers' rendezvous failed: {exc}. A retry may find its peers"
        ) from exc


TaskPlugins.register_pythontask_plugin(LocalSafeElastic, LocalSafeElasticTask)
TaskPlugins.register_pythontask_plugin(ClassicPyTorch, ClassicPyTorchTask)


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
