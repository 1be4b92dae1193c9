"""The training pod's exit code, by the PyTorchJob convention (`restartPolicy: ExitCode`): 0 for
success, 1-127 for a permanent failure that a restart would repeat (bad config or data, a bug),
128-255 for a retryable one (a fault of the machine: a killed worker, a rendezvous that timed
out, a storage or MLflow 5xx).

flytekit's `pyflyte-execute` exits 0 whatever happened (the error is a document it uploads for
Flyte to read), so the training task's container command runs it under this wrapper:

    python -m flyscale.cluster.exit_codes pyflyte-execute --inputs ... --resolver ... -- ...

The task itself (flyscale/cluster/launchers.py) records how it failed in the file this wrapper names in
FLYSCALE_EXIT_CODE_FILE; the wrapper exits with that code, or with 128 + N when the task's
process died of signal N or its torch-elastic agent was stopped by it (SIGTERM from a preempted
node: 143). Flyte's own retries read the
error document's kind, which says the same thing (FlyteRecoverableException).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from flyscale import settings

SUCCESS, PERMANENT, RETRYABLE = 0, 1, 143
ENV = settings.EXIT_CODE_FILE.name


def signal_of(exc: BaseException) -> int:
    """The signal torch-elastic's agent was stopped by, where `exc` comes of that (flytekit
    re-raises the agent's SignalException as IgnoreOutputs); 0 otherwise."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SignalException):
            return int(seen.sigval)
        seen = seen.__cause__ or seen.__context__
    return 0


def code_for(exc: BaseException) -> int:
    """The exit code a failure of the task means."""
    from flytekit.core.base_task import IgnoreOutputs
    from flytekit.exceptions.user import FlyteRecoverableException

    signum = signal_of(exc)  # torch-elastic's agent got SIGTERM (a preempted node) or SIGINT
    if signum:
        return 128 + signum
    if isinstance(exc, IgnoreOutputs):  # a pod without global rank 0 finished: only rank 0 writes outputs
        return SUCCESS
    return RETRYABLE if isinstance(exc, FlyteRecoverableException) else PERMANENT


def record(exc: BaseException) -> None:
    """Say how the task failed, for the wrapper, when one runs it (a no-op otherwise)."""
    path = settings.EXIT_CODE_FILE.get()
    if path:
        with open(path, "w") as f:
            f.write(f"{code_for(exc)} {type(exc).__name__}\n")


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """Record how the block failed (see `record`), then let the exception go on."""
    try:
        yield
    except Exception as exc:
        record(exc)
        raise


def wrapped(command: list[str]) -> list[str]:
    """A task's container command (pyflyte-execute ...) under this wrapper."""
    return ["python", "-m", "flyscale.cluster.exit_codes", *command]


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit("usage: python -m flyscale.cluster.exit_codes pyflyte-execute ARGS...")
    with tempfile.NamedTemporaryFile(prefix="flyscale-exit-", suffix=".txt", delete=False) as f:
        verdict = f.name
    try:
        child = subprocess.Popen(argv, env={**os.environ, ENV: verdict})
        for sig in (signal.SIGTERM, signal.SIGINT):  # the kubelet's SIGTERM reaches the task's process
            signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
        code = child.wait()
        if code < 0:  # the task's process died of a signal
            return 128 - code
        with open(verdict) as f:
            text = f.read().split()
        # The task's own verdict; else the entrypoint's code (non-zero if it could not even load the task).
        return int(text[0]) if text else code
    finally:
        os.unlink(verdict)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
