"""What a run's results rest on: when each task's body ran, and so which came from the cache.

Every cached task returns a `TaskRun` stamped when its body ran: its outputs end in `run`, which
`@stamped`, under its `@task`, fills in. A cache hit hands back the
outputs of the run that computed them, stamp included, so a stamp from before this execution
started means "served from the cache". The start is the stamp of the first task, which is never
cached. (Flyte's local executor names every execution "local", so execution ids cannot tell
runs apart; wall-clock stamps can. Two executions running at once could misreport a result the
other computed moments earlier as computed here.)
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from flyscale.flyte import heap


@dataclass
class TaskRun:
    """One execution of a task's body."""

    task: str
    started_at: float  # unix seconds
    seconds: float = 0.0
    execution: str = ""  # the first task's stamp only: execution_key() where the execution runs

    @classmethod
    def start(cls, task: str, execution: str = "") -> TaskRun:
        return cls(task=task, started_at=time.time(), execution=execution)

    def done(self) -> TaskRun:
        """This stamp with the body's duration filled in; return it as the task's output."""
        return TaskRun(self.task, self.started_at, time.time() - self.started_at, self.execution)

    def cached(self, execution_started: float) -> bool:
        """True when this stamp is older than the execution that now holds it."""
        return self.started_at < execution_started


# A stage's `run` output before `stamped` fills it in: a stage's outputs end `run: TaskRun = UNSTAMPED`.
UNSTAMPED = TaskRun(task="", started_at=0.0)

F = TypeVar("F", bound=Callable[..., Any])


def stamped(body: F) -> F:
    """A task's body whose outputs (a NamedTuple) end in `run`: the stamp of when the body ran is
    put there, so that no stage starts and finishes one by hand. Put it under `@task`; the task
    keeps the body's name, signature and module. None (a training worker's outputs, which are not
    the task's) passes through. The first stage a process runs also freezes its heap
    (flyscale/flyte/heap.py: the imports are done by then)."""

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        heap.settle()
        started = TaskRun.start(body.__name__)
        out = body(*args, **kwargs)
        return out if out is None else out._replace(run=started.done())

    return run  # type: ignore[return-value]


def execution_id() -> str:
    """The Flyte execution this runs in (`project:domain:name`; `local` for a local run)."""
    try:
        from flytekit import current_context

        e = current_context().execution_id
        return ":".join(p for p in (e.project, e.domain, e.name) if p) or "local"
    except Exception:  # noqa: BLE001 (outside a task, a notebook or a test, there is no execution)
        return "none"


def execution_key() -> str:
    """What names one pipeline execution in every task of it, the failure handler included.

    On a cluster that is Flyte's execution id. Locally every execution is called `local`, but
    all of an execution's tasks outside the training workers run in the one `pyflyte run`
    process, so the host and that process tell concurrent executions apart. Call it in a task
    that runs in that process (not in a training worker: take it from the first task's stamp).
    """
    ident = execution_id()
    if ident.split(":")[-1] in ("local", "none"):
        return f"local:{socket.gethostname()}:{os.getpid()}"
    return ident


@dataclass
class CacheReport:
    """Which tasks ran in this execution and which were served from the cache."""

    ran: list[str]
    cached: list[str]
    always: list[str]  # tasks that are never cached: they read live state (new data, the champion)

    @classmethod
    def of(cls, runs: list[TaskRun], execution_started: float, always: list[str]) -> CacheReport:
        return cls(
            ran=[r.task for r in runs if not r.cached(execution_started)],
            cached=[r.task for r in runs if r.cached(execution_started)],
            always=list(always),
        )

    def status(self) -> dict[str, str]:
        """{task: "hit" | "miss" | "always runs"} for MLflow tags."""
        return {
            **{t: "miss" for t in self.ran},
            **{t: "hit" for t in self.cached},
            **{t: "always runs" for t in self.always},
        }
