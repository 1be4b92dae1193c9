"""Flyte's side of recovery: checkpoints through Flyte's intra-task checkpoint API, and which
failures Flyte should retry.

What an attempt saves through `current_context().checkpoint` the next attempt restores (and
only the next: a restart of the worker group inside the same attempt reads the local restart
directory instead; see flyscale/train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from flytekit.exceptions.user import FlyteRecoverableException

from flyscale.train.checkpoint_files import ASIDE, MANIFEST, NoIntactCheckpoint, complete_checkpoints
from flyscale.train.distributed import LostPeer
from flyscale.train.interrupt import Interrupted, leave_note

log = logging.getLogger(__name__)


@contextlib.contextmanager
def lost_peers_retryable() -> Iterator[None]:
    """In a training worker: a lost peer is a fault of the machine, so Flyte may retry the task
    (flytekit's Elastic task keeps a FlyteRecoverableException raised in a worker retryable).

    So is a stop on a signal (`Interrupted`: a Ctrl-C, a preempted pod's SIGTERM), after its
    checkpoint: a retry resumes from it. Where the signal reached the launcher too, the launcher
    reports the interruption instead (`launchers.interruptions_said`), from the note left here.

    So are checkpoints of which none is whole (`NoIntactCheckpoint`): a crash or the disk tore
    them, a fault of the machine, not of the config or the data."""
    try:
        yield
    except (LostPeer, NoIntactCheckpoint) as exc:
        raise FlyteRecoverableException(str(exc)) from exc
    except Interrupted as exc:
        leave_note(exc)
        raise FlyteRecoverableException(str(exc)) from exc


class FlyteMirror:
    """flyscale's `Mirror` on Flyte's checkpoint API (a flytekit `SyncCheckpoint`).

    Each checkpoint goes up as `step-N/`: its files first, its manifest in a second upload, so
    an upload cut short by preemption is recognisably incomplete. The newest `keep` are kept.
    """

    def __init__(self, checkpoint, keep: int):
        self._cp, self._keep = checkpoint, keep

    @classmethod
    def current(cls, keep: int) -> FlyteMirror | None:
        """The running task's checkpoint API, or None where Flyte gives none (a local run)."""
        from flytekit import current_context

        try:
            checkpoint = current_context().checkpoint
        except (NotImplementedError, AttributeError):
            return None
        return cls(checkpoint, keep) if checkpoint is not None else None

    def restore(self) -> Path | None:
        # A failing download raises: an unreachable store is an error, never "no checkpoint".
        return self._cp.restore()

    def save(self, checkpoint: Path) -> None:
        with tempfile.TemporaryDirectory(dir=checkpoint.parent) as tmp:
            files, manifest = Path(tmp) / "files" / checkpoint.name, Path(tmp) / "manifest" / checkpoint.name
            files.mkdir(parents=True)
            manifest.mkdir(parents=True)
            for f in checkpoint.rglob("*"):  # a sharded checkpoint's DCP files are one folder down
                relative = f.relative_to(checkpoint)
                if f.is_file() and relative != Path(MANIFEST):
                    (files / relative).parent.mkdir(parents=True, exist_ok=True)
                    os.link(f, files / relative)  # same filesystem: no copy
            shutil.copy2(checkpoint / MANIFEST, manifest / MANIFEST)
            self._cp.save(files.parent)
            self._cp.save(manifest.parent)
        self._prune(checkpoint.parent)

    def _prune(self, local_root: Path) -> None:
        """Drop uploaded checkpoints older than the newest `keep` (those are what the local
        directory still holds)."""
        from flytekit.core.context_manager import FlyteContextManager

        kept = {p.name.removesuffix(ASIDE) for p in complete_checkpoints(local_root)}
        dest = str(getattr(self._cp, "_checkpoint_dest", ""))  # flytekit has no public name for it
        if not dest:
            return
        try:
            fs = FlyteContextManager.current_context().file_access.get_filesystem_for_path(dest)
            for path in fs.ls(dest, detail=False):
                name = path.rstrip("/").rsplit("/", 1)[-1]
                if name.startswith("step-") and name not in kept:
                    fs.rm(path, recursive=True)
        except Exception as exc:  # noqa: BLE001 (the checkpoint itself went up; old ones stay)
            log.warning("could not prune old checkpoints under %s: %s", dest, exc)
