"""Run directories: where one training keeps its checkpoints between restarts, found again by
what it trains, held while it trains, and removed when nobody will resume from them.

A run directory is `<base>/run-<key>`, the key a hash of everything that makes the training
what it is: the data's fingerprint, the model and train config, the launcher and world size,
and the code (see `training_key`). The same command run again after a Ctrl-C or a crash has
the same key, so it finds the checkpoints its first try left and resumes from them; another
config, other data or other code has another key and starts afresh.

Rank 0 holds the directory while it trains with an advisory lock (`flock` on `.lock` inside
it), which the kernel drops however the process ends, so no stale lock outlives a crash. A
second run of the same training started while the first still runs finds the lock held and
takes a directory of its own (`run-<key>-<owner>`): the two never write one checkpoint, and
the second never resumes from a checkpoint the first is still writing. Pruning and
`flyscale checkpoints` skip or mark directories that are held.

Looking at a lock takes it for an instant (`flock` cannot be asked who holds it), and so does
`prune`, which deletes a directory only while it holds the lock itself: it renames the directory
out of the way under the lock (an instant), then deletes it unheld. So a starting run that finds
the lock held retries for `PATIENCE_S` before it goes apart, and once it has the lock checks that
the lock file is still the directory's (not one `prune` moved away). A probe or a prune can thus
never send a starting run to a directory of its own; only a run that holds the lock for longer does.

The other ranks find the directory rank 0 claimed by its name, under their own base
(`restart_directory`): on several nodes that base must be one volume every node mounts, which
is proved before training (`shared_disk.check_shared`) rather than found out at the first
checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flyscale.train.checkpoint_files import CheckpointError, complete_checkpoints, step_of
from flyscale.train.shared_disk import check_shared, together

if TYPE_CHECKING:
    from flyscale.train.distributed import DistContext

log = logging.getLogger(__name__)

DEFAULT_BASE = Path.home() / ".flyscale" / "checkpoints"  # recovery.checkpoint_dir's default

LOCK = ".lock"

# How long a starting run retries a held lock before it goes apart: many times what a probe or a
# prune holds it for (microseconds), little beside a training's start.
PATIENCE_S = 2.0

PRUNED = ".pruned-"  # a directory `prune` moved aside to delete (not `run-*`: nothing lists it)


def base_directory(base: str) -> Path:
    return Path(base).expanduser() if base else DEFAULT_BASE


def training_key(facts: Mapping[str, Any]) -> str:
    """The key of a training: a hash of the facts that decide what it computes (JSON-able)."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_directory(base: str, key: str) -> Path:
    """The restart directory of the training `key` under `base` (or ~/.flyscale/checkpoints)."""
    return base_directory(base) / f"run-{key}"


def _lock_now(directory: Path, create: bool) -> int | None:
    """An fd holding the lock of `directory` as it is now, or None where another holds it (or,
    without `create`, where the directory is gone)."""
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        return None  # deleted meanwhile (only without `create`)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held, there = os.fstat(fd), os.stat(directory / LOCK)
        if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)  # held, or a lock `prune` moved away with its directory while we took it
    return None


def _try_lock(directory: Path, owner: str, patience_s: float = PATIENCE_S) -> int | None:
    """An fd holding `directory`'s lock (the file then names `owner`), or None if another holds it
    for longer than `patience_s` (module docstring: a probe or a prune holds it for an instant)."""
    deadline = time.monotonic() + patience_s
    while (fd := _lock_now(directory, create=True)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if fd is None:
        return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"owner": owner, "pid": os.getpid(), "host": os.uname().nodename}).encode())
    return fd


def holder(directory: Path) -> str:
    """Who holds `directory`'s lock, as its lock file says ("" when unreadable)."""
    try:
        info = json.loads((directory / LOCK).read_text())
        return f"{info['owner']} (pid {info['pid']} on {info['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def is_held(directory: Path) -> bool:
    """Whether a live process holds `directory`'s lock now (taking it for an instant to see)."""
    if not (directory / LOCK).is_file():
        return False
    fd = os.open(directory / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken just now
    return False


@contextlib.contextmanager
def claimed_directory(base: str, key: str, owner: str) -> Iterator[Path]:
    """The restart directory for training `key`, held by this process until the block ends.

    `owner` names this run (its execution and start). A run that fell back to a directory of
    its own before (a restart of its workers, a retry) goes back to it; otherwise it takes the
    training's shared directory, or its own where another live run holds that one.
    """
    shared = run_directory(base, key)
    apart = shared.with_name(f"{shared.name}-{hashlib.sha256(owner.encode()).hexdigest()[:8]}")
    candidates = [apart] if complete_checkpoints(apart) else [shared, apart]
    for directory in candidates:
        fd = _try_lock(directory, owner)
        if fd is None:
            log.warning(
                "another run of the same training (the same config, data, launcher and code) is "
                "checkpointing in %s: %s. This one keeps its checkpoints apart and does not resume from those",
                directory,
                holder(directory) or "its lock file is unreadable",
            )
            continue
        try:
            yield directory
        finally:
            os.close(fd)
        return
    raise CheckpointError(f"run {owner} already holds its own checkpoint directory {apart} in another process")


@contextlib.contextmanager
def restart_directory(ctx: DistContext, base: str, key: str, owner: str, probe: bool = True) -> Iterator[Path]:
    """The run directory every rank checkpoints in: rank 0 claims it (`claimed_directory`) and
    holds it until the block ends; every rank finds it by that name under its own `base`, which
    on several nodes must be one volume that every node mounts. `probe`: prove that it is
    (`check_shared`) before anything trains. Every rank enters every collective here, and a
    failure on any rank (the claim is rank 0's alone) raises on every rank."""
    with contextlib.ExitStack() as held:

        def claim() -> str:
            return held.enter_context(claimed_directory(base, key, owner)).name if ctx.is_main else ""

        root = base_directory(base) / together(ctx, claim)[0]
        if probe:
            check_shared(ctx, root, base)
        yield root


@dataclass
class RunCheckpoints:
    """One run directory under the checkpoint base, as `flyscale checkpoints` lists it."""

    path: Path
    steps: list[int]  # its complete checkpoints' steps, oldest first
    bytes: int
    modified: float  # the newest file's mtime: when the run last wrote
    held: bool  # a live run is training in it


def run_directories(base: str) -> list[RunCheckpoints]:
    """Every run directory under `base` (or ~/.flyscale/checkpoints), least recently written first."""
    root = base_directory(base)
    runs = []
    for run in sorted(root.glob("run-*")) if root.is_dir() else []:
        stats = [f.stat() for f in run.rglob("*") if f.is_file() and f.name != LOCK]
        runs.append(
            RunCheckpoints(
                run,
                [step_of(p) for p in complete_checkpoints(run)],
                sum(st.st_size for st in stats),
                max((st.st_mtime for st in stats), default=run.stat().st_mtime),
                is_held(run),
            )
        )
    return sorted(runs, key=lambda r: r.modified)


def prune(base: str, older_than_s: float, now: float | None = None) -> list[Path]:
    """Delete the run directories under `base` not written for `older_than_s` and held by no live
    run; what was deleted. Each is taken with its lock and moved aside before it is deleted, so a
    run starting in it meanwhile waits an instant, then starts afresh in its place (module docstring)."""
    now = time.time() if now is None else now
    try:
        runs = run_directories(base)
        root = base_directory(base)
        for left in root.glob(PRUNED + "*"):  # a prune cut short
            shutil.rmtree(left, ignore_errors=True)
    except OSError as exc:  # housekeeping: an unreadable base (or a folder deleted meanwhile) stops no training
        log.warning("could not look for old checkpoints to delete under %s: %s", base_directory(base), exc)
        return []
    gone = []
    for run in runs:
        if now - run.modified <= older_than_s or run.held:
            continue
        fd = _lock_now(run.path, create=False)
        if fd is None:  # a run holds it now
            continue
        try:
            if now - _last_written(run.path) <= older_than_s:  # written since it was listed
                continue
            trash = root / f"{PRUNED}{run.path.name}-{os.getpid()}"
            run.path.rename(trash)
        except OSError as exc:
            log.warning("could not delete the checkpoints of an old run %s: %s", run.path, exc)
            continue
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("deleted checkpoints of an old run: %s", run.path)
        gone.append(run.path)
    return gone


def _last_written(run: Path) -> float:
    """When anything in run directory `run` (its lock file aside) was last written."""
    times = [f.stat().st_mtime for f in run.rglob("*") if f.is_file() and f.name != LOCK]
    return max(times, default=run.stat().st_mtime)
