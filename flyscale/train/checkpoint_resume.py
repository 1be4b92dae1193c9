"""Loading a run's checkpoint back on every rank: which one (rank 0 chooses for all, the newest
whole one of the run's own, `recovery.resume_from`'s and the mirror's), how a resume on another
number of workers keeps its global batch, and each rank's share read back where it stands.
`Checkpointer` hands its resume here; the layout and the checks are checkpoint.py's docstring.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from flyscale.train import reshard
from flyscale.train.checkpoint_choice import holds_best, newest_whole, same_model, visible
from flyscale.train.checkpoint_commit import Mirror
from flyscale.train.checkpoint_files import MANIFEST, STATE, CheckpointError, NoIntactCheckpoint, same_strategy
from flyscale.train.distributed import DistContext
from flyscale.train.reshard import Reshard
from flyscale.train.shared_disk import together
from flyscale.train.state import Position, Resumed, TrainState, set_rng_state

log = logging.getLogger(__name__)


class Resumer:
    """Restores the newest checkpoint of a run into every rank's training state.

    Every rank calls every method (they contain collectives); rank 0 alone chooses the checkpoint.
    """

    def __init__(self, root: Path, resume: bool, resume_from: str, mirror: Mirror | None):
        self.root, self.resume, self.resume_from, self.mirror = root, resume, resume_from, mirror
        self._chosen: tuple[Path, str, dict[str, Any]] | None = None  # `reshard_plan`'s choice, for `restore`
        self._rng_after_skip: dict[str, Any] | None = None  # what `restore_rng` puts back

    def reshard_plan(self, ctx: DistContext, per_worker_batch: bool = True) -> Reshard | None:
        """When the checkpoint a resume would load was written by another number of workers: how
        this run keeps its global batch (see reshard.py; `per_worker_batch` as the strategy
        says). None otherwise, and when there is nothing to resume. Call it before the loader is
        built."""

        def shape() -> tuple[int, int, int] | None:
            if not (ctx.is_main and self.resume):
                return None
            try:
                self._chosen = self._choose()
                if self._chosen is not None:
                    m = self._chosen[2]
                    return m["world_size"], m.get("global_batch", 0), m.get("grad_accum_steps", 1)
            except (CheckpointError, NoIntactCheckpoint, OSError, ValueError, KeyError):
                pass  # restore() finds it again and says what is wrong
            return None

        saved = together(ctx, shape)[0]  # rank 0's look, on every rank (its failure too)
        if saved is None or saved[0] == ctx.world_size or not saved[1]:
            return None
        world, global_batch, accum = saved
        try:
            return reshard.plan(world, global_batch, accum, ctx.world_size, per_worker_batch)
        except reshard.ReshardError as exc:
            raise CheckpointError(str(exc)) from None

    def restore(self, state: TrainState, ctx: DistContext, strategy: str) -> tuple[Position, Resumed] | None:
        """Load the newest checkpoint of this run into `state`: from the local restart directory,
        or from the mirror (the previous Flyte attempt) where that holds a newer one.

        None when there is none (or `resume` is off). A damaged newest one is passed over for
        the newest whole one, never quietly: a warning names each passed over and what is wrong,
        and the source the resume reports says it fell back; where none is whole,
        NoIntactCheckpoint (retryable). An incompatible one, or a damaged one that
        `recovery.resume_from` names, raises CheckpointError. Whatever rank 0 meets, every rank raises.
        """
        if not self.resume:
            return None

        def choose() -> tuple[str, str] | None:
            if not ctx.is_main:
                return None
            found, self._chosen = self._chosen or self._choose(), None
            if found is None:
                return None
            path, source, manifest = found
            same_strategy(path, manifest, strategy)
            # In the run directory: by its name, which every rank finds under its own root.
            return (path.name if path.parent == self.root else str(path)), source

        # One rank chooses, so that every rank loads the same checkpoint; its failure is everyone's.
        choice = together(ctx, choose)[0]
        if choice is None:
            return None
        where, source = choice
        path = self.root / where  # `where` absolute (recovery.resume_from): that path

        def read_mine() -> tuple[int, dict[str, Any]]:
            manifest = json.loads(visible(path, MANIFEST, ctx).read_text())
            saved_world = manifest["world_size"]
            ranks = [ctx.rank] if saved_world == ctx.world_size else range(saved_world)
            files = [visible(path, f"rank-{r}.pt", ctx) for r in ranks]
            visible(path, f"{STATE}/.metadata", ctx)
            loaded = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
            # Resharded: every saved rank's place in the data.
            mine = loaded[0] if saved_world == ctx.world_size else reshard.rank_state(loaded, ctx.rank)
            same_model(path, state)  # a pipeline stage checks its own layers: it may fail alone
            return saved_world, mine

        # Every rank reads its own files, where it stands; any rank that cannot stops them all
        # (only the verdicts travel: each rank keeps what it read).
        read: list[tuple[int, dict[str, Any]]] = []
        together(ctx, lambda: read.append(read_mine()))
        saved_world, mine = read[0]
        if holds_best(path):  # early stopping's best epoch so far: room for it, for DCP to fill
            state.keep_best()
        # Collective: each rank reads the slices of what was saved that make up what it holds now.
        held = state.sharded_state()
        import torch.distributed.checkpoint as dcp  # not at the top: every pyflyte run imports this module; only training needs DCP (and DTensor, sympy)

        dcp.load(held, checkpoint_id=path / STATE)
        state.load_sharded_state(held)
        state.load_schedule_state(mine["schedule"])
        position = Position(**mine["position"])
        self._rng_after_skip = mine["rng"]
        log.info(
            "resuming from checkpoint %s (%s): step %d, epoch %d, batch %d",
            path,
            source,
            position.step,
            position.epoch + 1,
            position.batch,
        )
        return position, Resumed(step=position.step, source=source, path=str(path), world_size=saved_world)

    def _choose(self) -> tuple[Path, str, dict[str, Any]] | None:
        restored = self.mirror.restore() if self.mirror is not None else None
        return newest_whole(self.root, self.resume_from, restored)

    def restore_rng(self) -> None:
        """Put back the RNG states of the checkpoint `restore` loaded. Call it once the resumed
        epoch's loader has skipped the batches already done, as the saving run stood then."""
        state = self._rng_after_skip
        if state is not None:
            set_rng_state(state)
            self._rng_after_skip = None
