"""Committing a checkpoint so that no crash can tear it, and the work of a commit that training
does not wait for.

The commit of step N, by rank 0, once every rank has written and fsynced its files under
`step-N.partial/` (DCP fsyncs its own; `checkpoint_files.write_bytes` the rank files):

    1. write manifest.json (through a temporary name, fsynced), fsync `state/` and the directory;
    2. where a `step-N` exists already (the same step saved again after a restart): rename it
       to `step-N.old`, fsync the parent;
    3. rename `step-N.partial` to `step-N`, fsync the parent;
    4. delete `step-N.old`.

At every moment a whole step-N exists under one of two names: a kill before 3 leaves
`step-N.old` (or the earlier `step-N`) and an unfinished or unrenamed `.partial`, which nothing
reads; `complete_checkpoints` takes `step-N.old` where there is no `step-N`, and a later commit
clears what a crash left. The fsyncs order the writes on the disk as they are ordered here, so a
power loss leaves the same states a kill does (a kill alone loses nothing the kernel holds).

Off the training thread (a thread of the `Checkpointer`'s own, `Background`): each rank hashes
the DCP files it wrote (`__<rank>_*.distcp`, rank 0 also `.metadata`) once an asynchronous save
has written them, so the commit only gathers the hashes; and rank 0 uploads each committed
checkpoint to the mirror. An upload's failure is raised at the next save, or at `wait`, never
dropped; the next commit waits for the upload before it prunes what the upload may still read.
"""

from __future__ import annotations

import contextvars
import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from flyscale.train.checkpoint_files import (
    ASIDE,
    MANIFEST,
    PARTIAL,
    complete_checkpoints,
    fsync_dir,
    hash_files,
    write_bytes,
)

T = TypeVar("T")


class Mirror(Protocol):
    """A second home for checkpoints that outlives this attempt (Flyte's checkpoint API)."""

    def restore(self) -> Path | None:
        """A local directory holding what an earlier attempt saved, or None."""

    def save(self, checkpoint: Path) -> None:
        """Copy the complete checkpoint directory `checkpoint` there."""


def state_files_of(state: Path, rank: int) -> list[str]:
    """The names of the DCP files rank `rank` wrote in `state` (DCP names them by the writer's
    rank in its group, which is the global rank here), and rank 0's also `.metadata`."""
    names = [f.name for f in state.iterdir() if f.name.startswith(f"__{rank}_") and f.name.endswith(".distcp")]
    return names + ([".metadata"] if rank == 0 else [])


def hash_state(state: Path, rank: int, under: str) -> dict[str, dict[str, Any]]:
    """{`under`/name: size and sha256} of the DCP files rank `rank` wrote in `state`."""
    return hash_files(state, state_files_of(state, rank), under)


def replace_step(partial: Path, final: Path) -> None:
    """Rename the whole checkpoint `partial` to `final` (steps 2-4 of the module docstring): a
    `final` already there goes aside first, so a whole one of that step is there at every moment."""
    aside = final.with_name(final.name + ASIDE)
    parent = final.parent
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a crash's leftover: `final` is whole
        final.rename(aside)
        fsync_dir(parent)
    partial.rename(final)
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def commit(partial: Path, final: Path, manifest: dict[str, Any], state: str) -> None:
    """Rank 0's commit of a checkpoint every rank has written under `partial` (module docstring)."""
    write_bytes(json.dumps(manifest, indent=1).encode(), partial / MANIFEST)
    fsync_dir(partial / state)
    fsync_dir(partial)
    replace_step(partial, final)


def clear_leftovers(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `root`, and what crashes left:
    a `step-N.old` beside its `step-N`, and unfinished `.partial` directories (one save is in
    flight at a time, and it has just been committed)."""
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for left in root.glob("step-*"):
        torn = left.name.endswith(PARTIAL)
        replaced = left.name.endswith(ASIDE) and left.with_name(left.name.removesuffix(ASIDE)).is_dir()
        if torn or replaced:
            shutil.rmtree(left, ignore_errors=True)


class Background:
    """One thread of a checkpointer's own for work training does not wait for, made at its first use."""

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Run `work` on the thread (after what was submitted before), in the context variables
        of the caller (flytekit keeps the task's context, and its storage, in one); its future."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        return self._pool.submit(contextvars.copy_context().run, work)


def upload(mirror: Mirror, checkpoint: Path) -> None:
    """`mirror.save(checkpoint)`, its failure naming the checkpoint."""
    try:
        mirror.save(checkpoint)
    except Exception as exc:
        exc.add_note(f"(uploading checkpoint {checkpoint} to the mirror, the previous attempt's store, failed)")
        raise
