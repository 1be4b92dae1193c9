"""Resuming a checkpoint on another number of workers: what changes and what may not.

A checkpoint's model and optimizer tensors are written through DCP, which loads them at any
world size: each rank reads the slices of what was saved that make up what it holds now (its
shards under fsdp, its stage under the pipeline, the whole model under ddp). What must carry
over besides the weights is the run itself:

- the global batch: every optimizer step averages the same number of rows as before, so the
  per-worker batch becomes global / workers, with gradient accumulation keeping each
  micro-batch the size it was where that divides. A global batch the new count does not divide
  is refused, naming the counts that do.
- the place in the data: the sampler's permutation depends only on (seed, epoch), and the first
  b global batches are its first b x global rows at any world size (rank r takes every
  world-th row), so a resumed epoch skips the same b batches and goes on with the same rows.
  (Only the sampler's padding of a size the world size does not divide differs: a row or two
  of the epoch's last batch.)
- the epoch's partial sums: the rows and losses of the batches done so far are summed over the
  ranks that did them and carried by the new rank 0, so the epoch reports what it would have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flyscale.config import TrainConfig


class ReshardError(ValueError):
    """A checkpoint that cannot be resumed on this many workers: the message says why and what can."""


@dataclass(frozen=True)
class Reshard:
    """How a run written by `saved_world` workers resumes on `world`."""

    saved_world: int
    world: int
    global_batch: int
    batch_size: int  # per worker, now
    grad_accum_steps: int

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        return dataclasses.replace(cfg, batch_size=self.batch_size, grad_accum_steps=self.grad_accum_steps)

    def sentence(self) -> str:
        accumulate = f", accumulating {self.grad_accum_steps} micro-batches" if self.grad_accum_steps > 1 else ""
        return (
            f"resharded from {self.saved_world} workers to {self.world}: the global batch of {self.global_batch} "
            f"rows kept as {self.batch_size} a worker{accumulate}"
        )


def plan(saved_world: int, global_batch: int, saved_accum: int, world: int, per_worker_batch: bool = True) -> Reshard:
    """The per-worker batch and accumulation on `world` workers that keep `global_batch`. A
    strategy whose every worker sees the global batch (`per_worker_batch` False: pipelining)
    keeps it as it is."""
    if not per_worker_batch:
        return Reshard(saved_world, world, global_batch, global_batch, saved_accum)
    if global_batch % world:
        fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise ReshardError(
            f"the checkpoint was written by {saved_world} workers at a global batch of {global_batch} rows, which "
            f"{world} workers cannot split evenly; resume on a worker count that divides it ({', '.join(map(str, fits))}), "
            f"or start afresh (recovery.resume: false)"
        )
    batch = global_batch // world
    micro = max(1, global_batch // saved_world // max(saved_accum, 1))  # each micro-batch's rows before
    accum = batch // micro if batch % micro == 0 and batch >= micro else 1
    return Reshard(saved_world, world, global_batch, batch, accum)


def rank_state(files: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """What new `rank` resumes with, from every saved rank's file ({"position", "rng", ...}): the
    epoch's partial sums over all of them on rank 0 (none elsewhere), the rest from the saved rank
    `rank` wraps onto (its RNG states: a dropout mask will differ from an uninterrupted run's)."""
    own = dict(files[rank % len(files)])
    position = dict(own["position"])
    if rank == 0:
        steps = len(position["losses"])
        position["losses"] = [sum(f["position"]["losses"][i] for f in files) for i in range(steps)]
        position["hits"] = [sum(f["position"]["hits"][i] for f in files) for i in range(len(position["hits"]))]
        position["rows"] = sum(f["position"]["rows"] for f in files)
    else:
        position.update(losses=[], hits=[], rows=0)
    own["position"] = position
    return own
