"""Ctrl-C keeps the work: SIGINT or SIGTERM asks training to stop; every rank finishes its step,
the ranks agree on one step to stop at, write one checkpoint there together, and the run says
where it stopped and that the same command resumes.

A terminal's Ctrl-C reaches every process of the job (torch-elastic's agent and each worker); a
preempted pod's SIGTERM reaches its agent, which passes it on to its workers. So signals reach
the ranks at different moments, and another node's ranks may get none: no rank stops on its own.
Each notes its signal (`StopSignals`), and the ranks vote at step boundaries (`StepVote`): one
all-reduce of three floats, about once a second whatever a step takes. The vote also carries the
checkpointer's "my clock says a checkpoint is due", so time-based checkpoints cost no collective
of their own.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from flyscale import settings

if TYPE_CHECKING:  # the launcher reads notes without importing torch
    from flyscale.train.distributed import DistContext

SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Seconds between votes, about: a stop waits at most this long (plus the step under way and the
# checkpoint) against torch-elastic's 30 s between passing a signal on and killing the workers;
# an all-reduce of three floats a second costs nothing a step would notice.
VOTE_EVERY_S = 1.0
MOST_STEPS_BETWEEN_VOTES = 1000


class StopSignals:
    """SIGINT and SIGTERM, while `installed`, as a request to stop at the next step the ranks
    agree on, instead of a KeyboardInterrupt wherever the process happens to be."""

    def __init__(self) -> None:
        self.received = 0  # the first signal's number; 0: none

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """The handlers while the block runs, then the ones before. Only the main thread may set
        handlers: elsewhere (a notebook's worker thread) signals stay as they were."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = {s: signal.signal(s, self._note) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)

    def _note(self, signum: int, _frame: object) -> None:
        # Repeats are expected (the terminal's SIGINT, then the agent's passing it on) and change
        # nothing; torch-elastic's agent kills a worker that has not stopped in its shutdown time.
        self.received = self.received or signum

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""


class StepVote:
    """Where the ranks agree, at a step boundary, on what each would decide by its own clock or
    its own signals: (a checkpoint is due by time on some rank, some rank was asked to stop).

    Votes come every `gap` steps, a gap worked out at each vote from the summed seconds since the
    last one, which every rank receives alike: so every rank votes at the same steps."""

    def __init__(self, step: int = 0, every_s: float | None = None, most_steps: int = MOST_STEPS_BETWEEN_VOTES):
        self.every_s = VOTE_EVERY_S if every_s is None else every_s
        self.most_steps = most_steps
        self._next, self._last, self._since = step + 1, step, time.monotonic()  # the first after one step
        self.step_seconds = 0.0  # a step's mean seconds, as of the latest vote (0 before the first)

    def due(self, step: int) -> bool:
        return step >= self._next

    def cast(self, step: int, ctx: DistContext, late: bool, stop: bool) -> tuple[bool, bool]:
        """Every rank calls it after the same step (`due`): (any rank late, any rank stopping)."""
        late_votes, stop_votes, seconds = ctx.all_reduce_sum([float(late), float(stop), time.monotonic() - self._since])
        self.step_seconds = seconds / ctx.world_size / max(1, step - self._last)
        gap = int(self.every_s / self.step_seconds) if self.step_seconds > 0 else self.most_steps
        self._next, self._last, self._since = step + max(1, min(self.most_steps, gap)), step, time.monotonic()
        return late_votes > 0, stop_votes > 0


class Interrupted(Exception):
    """Training stopped on a signal, on every rank after the same step; `checkpoint` is the one
    written there ("" when checkpoints are off, or the strategy keeps none)."""

    def __init__(self, step: int, signal: str, checkpoint: str = "", main: bool = True):
        self.step, self.signal, self.checkpoint = step, signal, checkpoint
        self.main = main  # raised on the main rank, which leaves the note
        super().__init__(self.sentence())

    def __reduce__(self):  # pickled whole (a worker's error crossing to its parent), not by its message
        return type(self), (self.step, self.signal, self.checkpoint, self.main)

    def sentence(self) -> str:
        if self.checkpoint:
            return f"interrupted at step {self.step}; the same command resumes"
        return (
            f"interrupted at step {self.step}; no checkpoint was written (recovery.checkpoint_every_steps and "
            f"recovery.checkpoint_every_minutes are 0, or the strategy keeps no training state), so the same "
            f"command starts training afresh"
        )


def leave_note(exc: Interrupted) -> None:
    """On the main rank, where the run that started the workers asked for it (FLYSCALE_INTERRUPT_NOTE):
    where training stopped, for that run to say as it exits."""
    path = settings.INTERRUPT_NOTE.get()
    if not (path and exc.main):
        return
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps({"step": exc.step, "signal": exc.signal, "checkpoint": exc.checkpoint}))
    tmp.replace(path)


def read_note(path: str) -> Interrupted | None:
    """The interruption the main rank noted at `path`, or None (it stopped before its first step
    or after its last, or was killed first)."""
    try:
        note = json.loads(Path(path).read_text())
        return Interrupted(int(note["step"]), str(note["signal"]), str(note["checkpoint"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
