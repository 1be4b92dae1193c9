"""How a training run's failures reach the user and Flyte: in a local run, a worker's own error
and an interruption each as the one line it is, not torch-elastic's report of every worker; and
faults of the machine (a killed worker, a failed rendezvous) as retryable, so that Flyte retries
the task and it resumes from its checkpoint. The training tasks' `execute` wraps itself in these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Iterator

from flyscale import settings
from flyscale.cluster import exit_codes
from flyscale.cluster.launcher_settings import in_pytorchjob
from flyscale.errors import RunInterrupted, UserError, verbose
from flyscale.train.interrupt import read_note


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
