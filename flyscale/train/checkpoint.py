"""Checkpoints: the whole training state, written atomically, found again after any restart.

A checkpoint is a directory `step-000000123/` holding

    state/          model and optimizer tensors, written by torch.distributed.checkpoint (DCP):
                    each rank writes what it holds (its shards under fsdp, its stage under the
                    pipeline strategy; what every rank holds alike, as under ddp, once), rank 0
                    the metadata that maps them to the whole tensors. DCP reads them back at
                    any world size, which is what lets a run resume on another number of
                    workers (reshard.py)
    rank-<r>.pt     every rank: its place in the data (epoch, batch, the epoch's partial sums),
                    its RNG states (Python, numpy, torch, CUDA), the optimizer's
                    hyperparameters, the LR scheduler's and the grad scaler's state
    manifest.json   written last, by rank 0: the step, the world size and global batch, the
                    strategy, and each file's size and sha256

Every file is written and fsynced under a `.partial` directory that is renamed into place only
when all ranks have written theirs, by a commit that leaves a whole checkpoint of the step at
every moment (`checkpoint_commit`: a kill -9 or a power loss at any point of it loses at most
the step being written). Damage (a missing, truncated or altered file) and incompatibility
(another model, another strategy) are found before anything is loaded (the manifest, DCP's
metadata). A damaged newest checkpoint (a crash or a disk tore it) is passed over, loudly, for
the newest whole one: a warning names it and what is wrong, and the resume says it fell back;
where none is whole the failure is `NoIntactCheckpoint`, which Flyte retries. An incompatible
one, and a damaged one that `recovery.resume_from` names, is refused with the path and what is
wrong. A full disk stops the save with `CheckpointWriteError`, naming the directory; the
checkpoint before stands. Rank files are read with `torch.load(weights_only=True)`: no pickle.

Three kinds of restart find them:
- torch-elastic restarting the worker group inside one Flyte attempt, and the same command run
  again after a Ctrl-C or a crash, which read the local restart directory (keyed by what is
  trained and held while it trains: `run_dirs`);
- Flyte retrying the task, which restores what the previous attempt uploaded through Flyte's
  checkpoint API (a `Mirror`, given by the training task; this module knows nothing of Flyte).

Ranks come only from the DistContext; the files are written, fsynced and hashed by the ranks
that own them (an asynchronous save's off the training thread), and rank 0 uploads to the
mirror from a thread of its own. The files, their manifest and their checks are in
`checkpoint_files`, the commit in `checkpoint_commit`, the choice of what a resume loads in
`checkpoint_choice`, the resume itself in `checkpoint_resume`; here, who writes what and when.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyscale.train.checkpoint_commit import Background, Mirror, clear_leftovers, commit, hash_state, upload
from flyscale.train.checkpoint_files import (
    FORMAT,
    PARTIAL,
    STATE,
    complete_checkpoints,
    disk_full,
    is_disk_full,
    step_dir,
    step_of,
    write_file,
)
from flyscale.train.checkpoint_resume import Resumer
from flyscale.train.distributed import DistContext
from flyscale.train.reshard import Reshard
from flyscale.train.shared_disk import together
from flyscale.train.state import Position, Resumed, TrainState, rng_state

log = logging.getLogger(__name__)


# recovery.checkpoint_every_minutes left unset: a checkpoint every tenth of the run, so that a run
# of a few minutes has some, but not more often than every 30 s (a run of seconds writes none: a
# Ctrl-C still writes its one) nor less often than every 5 minutes (the interval of long runs).
AUTO_FRACTION, AUTO_LEAST_S, AUTO_MOST_S = 0.1, 30.0, 300.0

# DCP warns on every save and load without a process group that it assumes one process (even
# when told so, and from the thread an asynchronous save writes in): for a run of one worker
# that is the normal case, not news. Only that message, only from DCP.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module="torch.distributed.checkpoint",
)


class Checkpointer:
    """Saves this rank's share of the training state on schedule, and restores the newest one.

    Every rank calls every method (they contain collectives); only the files a rank owns are
    written by it, and only rank 0 writes the manifest, renames, prunes and mirrors.
    """

    def __init__(
        self,
        root: Path,
        *,
        every_steps: int = 0,
        every_minutes: float | None = 0.0,
        keep: int = 2,
        resume: bool = True,
        resume_from: str = "",
        mirror: Mirror | None = None,
        global_batch: int = 0,
        grad_accum_steps: int = 1,
        asynchronous: bool = False,
    ):
        """`every_minutes` None: an interval that scales with the run (`interval_s`); 0: none by time."""
        self.root, self.every_steps = Path(root), every_steps
        self.every_seconds = None if every_minutes is None else every_minutes * 60
        self.keep, self.resume, self.mirror = keep, resume, mirror
        self.resume_from = resume_from
        self._resumer = Resumer(self.root, resume, resume_from, mirror)
        # Recorded in the manifest: what a run resumed on another number of workers must keep.
        self.global_batch, self.grad_accum_steps = global_batch, grad_accum_steps
        # Asynchronous: DCP copies the tensors to host memory and writes them from a thread while
        # training goes on; the checkpoint is committed (manifest, rename) once they are written.
        self.asynchronous = asynchronous
        self._pending: _Pending | None = None
        self._group: Any = None  # the process group of background writes, made at the first
        self._ctx: DistContext | None = None  # whose ranks saved: `wait` gathers them
        self._hashing, self._uploads = Background("checkpoint-hash"), Background("checkpoint-upload")
        self._upload: Future[None] | None = None  # rank 0's upload of the newest to the mirror
        self._last_save = time.monotonic()
        self._save_seconds = 0.0  # what the latest checkpoint held training up
        self.saved: list[int] = []  # steps this process checkpointed
        self.seconds_saving = 0.0  # wall time training waited on checkpoints, on this rank

    # -- saving -------------------------------------------------------------------------------

    @property
    def on(self) -> bool:
        """Whether this run checkpoints at all (by steps, by time, or on the automatic interval):
        a run with none configured also writes none when it is interrupted."""
        return bool(self.every_steps) or self.every_seconds != 0

    def begin(self) -> None:
        """Training starts now: the interval by time counts from here, not from the setup before
        (data read, a checkpoint restored), which would otherwise make the first step's checkpoint due."""
        self._last_save = time.monotonic()

    def due(self, step: int, late: bool = False) -> bool:
        """Whether to checkpoint after optimizer step `step`: every `every_steps` steps, and when
        some rank's clock says the interval has passed (`late`: `overdue` as the ranks voted on it,
        the same answer on every rank; flyscale/train/interrupt.py)."""
        return bool(self.every_steps and step % self.every_steps == 0) or late

    def overdue(self, run_seconds: float) -> bool:
        """Whether this rank's clock says a checkpoint is due by time. `run_seconds`: how long the
        whole training is expected to take, which the automatic interval scales with."""
        interval = self.interval_s(run_seconds)
        return interval > 0 and time.monotonic() - self._last_save >= interval

    def interval_s(self, run_seconds: float) -> float:
        """Seconds between checkpoints by time: recovery.checkpoint_every_minutes as set (0: none),
        or, left unset, a tenth of the expected run, between AUTO_LEAST_S and AUTO_MOST_S, and never
        under ten times what the latest checkpoint held training up (a tenth of the time at most)."""
        if self.every_seconds is not None:
            return self.every_seconds
        scaled = min(max(run_seconds * AUTO_FRACTION, AUTO_LEAST_S), AUTO_MOST_S)
        return max(scaled, 10 * self._save_seconds)

    def save(self, state: TrainState, position: Position, ctx: DistContext, strategy: str) -> Path:
        """Write checkpoint `position.step` from every rank; returns its directory.

        Asynchronous, it returns once the tensors are copied to host memory, and the checkpoint
        is committed by the next save, or by `wait` (`fit` calls it as training ends). A worker
        that dies before then loses that one; the one before it stands.
        """
        self._commit_pending()  # one save in flight at a time: the last one committed first
        start = time.perf_counter()
        self._ctx = ctx
        final = step_dir(self.root, position.step)
        partial = final.with_name(final.name + PARTIAL)

        def clear() -> None:
            if ctx.is_main:
                shutil.rmtree(partial, ignore_errors=True)  # a save cut short by an earlier crash
                partial.mkdir(parents=True)

        def write_mine() -> dict[str, Any]:
            # Every rank makes the directory it writes in: on its own node, rank 0's may not show yet.
            partial.mkdir(parents=True, exist_ok=True)
            rank_file = {"position": _position_dict(position), "rng": rng_state(), "schedule": state.schedule_state()}
            return {f"rank-{ctx.rank}.pt": write_file(rank_file, partial / f"rank-{ctx.rank}.pt")}

        manifest = {
            "format": FORMAT,
            "step": position.step,
            "epoch": position.epoch,
            "batch": position.batch,
            "world_size": ctx.world_size,
            "strategy": strategy,
            "global_batch": self.global_batch,
            "grad_accum_steps": self.grad_accum_steps,
        }
        state_dir = partial / STATE
        with self._full_disk_said(position.step, partial, ctx):
            # Every rank enters both, whatever fails where: no rank is left alone in a collective.
            together(ctx, clear)  # the others write once rank 0 has emptied the directory
            everyone = together(ctx, write_mine)  # also: every rank has written its files
            manifest["files"] = {k: v for part in everyone for k, v in part.items()}
            # Collective: each rank writes what it holds (its shards, its stage; a tensor every rank
            # holds alike is written once), rank 0 the metadata that maps them to the whole tensors.
            # Each rank hashes the files it wrote: asynchronous, on the checkpointer's thread once
            # they are written; else here, every rank its own at once.
            import torch.distributed.checkpoint as dcp  # not at the top: every pyflyte run imports this module; only training needs DCP (and DTensor, sympy)

            if self.asynchronous:
                written: Any = dcp.async_save(  # a Future of DCP's
                    state.sharded_state(),
                    checkpoint_id=state_dir,
                    process_group=self._writer_group(ctx),
                    no_dist=not ctx.distributed,
                )
                hashed = self._hashing.submit(lambda: (written.result(), hash_state(state_dir, ctx.rank, STATE))[1])
            else:
                dcp.save(state.sharded_state(), checkpoint_id=state_dir)
                hashed = Future()
                hashed.set_result(hash_state(state_dir, ctx.rank, STATE))
        self._pending = _Pending(hashed, partial, final, manifest, ctx)
        if not self.asynchronous:
            self._commit_pending()
        self._last_save = time.monotonic()
        self._save_seconds = time.perf_counter() - start
        self.saved.append(position.step)
        self.seconds_saving += self._save_seconds
        return final

    def wait(self) -> Path | None:
        """Commit the save in flight (if any), and wait for the mirror's upload of the newest
        checkpoint, raising its failure: as training ends or stops. The committed directory, or None."""
        final = self._commit_pending()
        if self._ctx is not None:  # every rank has saved, or none has
            start = time.perf_counter()
            together(self._ctx, self._uploaded)  # rank 0's upload: its failure stops every rank
            self.seconds_saving += time.perf_counter() - start
        return final

    def _commit_pending(self) -> Path | None:
        """Commit the save in flight: every rank's hashes to rank 0, which writes the manifest,
        renames the directory into place, prunes and starts the mirror's upload."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        with self._full_disk_said(step_of(pending.final), pending.partial, pending.ctx):
            # Entered by every rank: a commit that fails on rank 0 (a full disk, the mirror's
            # upload before) stops every rank with its error, not the others in their next collective.
            hashes = together(pending.ctx, pending.hashed.result)
            together(pending.ctx, lambda: self._commit(pending, hashes))
        if self.asynchronous:  # a synchronous save's own clock counts it
            self.seconds_saving += time.perf_counter() - start
        return pending.final

    def _commit(self, pending: _Pending, hashes: list[dict[str, Any]]) -> None:
        if not pending.ctx.is_main:
            return
        self._uploaded()  # before pruning what it may still be reading
        for mine in hashes:
            pending.manifest["files"].update(mine)
        pending.manifest["written_at"] = time.time()
        commit(pending.partial, pending.final, pending.manifest, STATE)
        clear_leftovers(self.root, self.keep)
        if self.mirror is not None:
            mirror, final = self.mirror, pending.final
            self._upload = self._uploads.submit(lambda: upload(mirror, final))

    def _uploaded(self) -> None:
        """Wait for the mirror's upload of the newest checkpoint (rank 0's); raise its failure."""
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.result()

    @contextlib.contextmanager
    def _full_disk_said(self, step: int, partial: Path, ctx: DistContext) -> Iterator[None]:
        """Where a full disk fails the block: the error saying so in one line, naming the directory
        (what the save wrote is deleted, to free the space; the checkpoint before stands)."""
        try:
            yield
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            if ctx.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            done = complete_checkpoints(self.root)
            raise disk_full(self.root, step, done[-1] if done else None) from exc

    def _writer_group(self, ctx: DistContext) -> Any:
        """A gloo group of its own for the background writes: their collectives must not
        interleave with training's on the default group. None in a single process."""
        if self._group is None and ctx.distributed:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def discard(self) -> None:
        """Delete this run's restart directory: training finished, nothing will resume from it."""
        shutil.rmtree(self.root, ignore_errors=True)

    # -- resuming (checkpoint_resume.py) ------------------------------------------------------

    def reshard_plan(self, ctx: DistContext, per_worker_batch: bool = True) -> Reshard | None:
        """How this run keeps its global batch when the checkpoint a resume would load was written
        by another number of workers, or None (`Resumer.reshard_plan`). Call it before the loader is built."""
        return self._resumer.reshard_plan(ctx, per_worker_batch)

    def restore(self, state: TrainState, ctx: DistContext, strategy: str) -> tuple[Position, Resumed] | None:
        """Load the newest whole checkpoint of this run into `state`, or None (`Resumer.restore`)."""
        return self._resumer.restore(state, ctx, strategy)

    def restore_rng(self) -> None:
        """Put back the RNG states of the checkpoint `restore` loaded, once the resumed epoch's
        loader has skipped the batches already done (`Resumer.restore_rng`)."""
        self._resumer.restore_rng()


@dataclass
class _Pending:
    """A save whose tensors may still be being written: `hashed` is done with this rank's hashes."""

    hashed: Future[dict[str, Any]]
    partial: Path
    final: Path
    manifest: dict[str, Any]
    ctx: DistContext  # whose ranks commit it together


def _position_dict(p: Position) -> dict[str, Any]:
    return {
        "step": p.step,
        "epoch": p.epoch,
        "batch": p.batch,
        "losses": list(p.losses),
        "hits": list(p.hits),
        "rows": p.rows,
        "wait": p.wait,
        "seconds": p.seconds,
        "history": list(p.history),
    }
