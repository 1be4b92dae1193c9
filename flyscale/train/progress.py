"""A progress bar for the training loop: on rank 0, on a terminal, and nowhere else.

In task logs (no terminal) a redrawn bar would be thousands of lines of carriage returns; the
loop's one log line per epoch already says what happened there, so the bar simply is not made.
When it is off, `fit` holds `None` and the per-step cost is one `is not None` test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

UPDATE_EVERY_S = 0.1


class TrainProgress:
    """Two rich bars, epochs and this epoch's steps, with the global throughput."""

    def __init__(self, progress: Progress, epochs: int, steps_per_epoch: int, world_size: int):
        self._progress = progress
        # Every rank runs as many steps as rank 0 (the sampler pads), so rank 0's count x world
        # estimates the global throughput that the epoch log reports exactly.
        self._scale = world_size
        self._epochs = progress.add_task("epochs", total=epochs, rate="")
        self._steps = progress.add_task("steps", total=steps_per_epoch, rate="")
        self._samples = 0
        self._pending = 0  # steps taken since the bar was last updated
        self._start = self._shown = time.perf_counter()

    def start_epoch(self) -> None:
        """Reset the step bar for a new pass over the data."""
        self._samples = self._pending = 0
        self._start = self._shown = time.perf_counter()
        self._progress.reset(self._steps, rate="")

    def step(self, batch_size: int) -> None:
        """One optimizer step on `batch_size` rows of this rank."""
        self._samples += batch_size
        self._pending += 1
        now = time.perf_counter()
        # The bar redraws ten times a second anyway: updating it on every step of a 1 ms step
        # would cost the step more than the bar is worth.
        if now - self._shown >= UPDATE_EVERY_S:
            self._flush(now)

    def end_epoch(self, samples_per_s: float) -> None:
        """Close an epoch with its measured global throughput."""
        self._flush(time.perf_counter())
        self._progress.update(self._epochs, advance=1, rate=f"{samples_per_s:,.0f} samples/s")

    def _flush(self, now: float) -> None:
        if not self._pending:
            return
        elapsed = now - self._start
        rate = self._samples * self._scale / elapsed if elapsed > 0 else 0.0
        self._progress.update(self._steps, advance=self._pending, rate=f"{rate:,.0f} samples/s")
        self._pending, self._shown = 0, now


def _columns() -> tuple:
    return (
        TextColumn("{task.description:>6}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
    )


@contextlib.contextmanager
def train_progress(
    epochs: int, steps_per_epoch: int, *, main: bool, world_size: int = 1, console: Console | None = None
) -> Iterator[TrainProgress | None]:
    """A `TrainProgress` while the block runs when `main` and the console is a terminal, else None."""
    console = (console or Console()) if main else None
    if console is None or not console.is_terminal:
        yield None
        return
    with Progress(*_columns(), console=console, transient=False) as progress:
        yield TrainProgress(progress, epochs, steps_per_epoch, world_size)
