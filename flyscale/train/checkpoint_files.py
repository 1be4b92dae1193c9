"""A checkpoint on disk: its directory, its files and their manifest, the checks that a
checkpoint is whole and this run's before anything is loaded, and the durable writes and
renames that commit one (the layout and the commit are checkpoint.py's docstring). No ranks
here: `Checkpointer` decides who writes what.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from flyscale.model import file_sha256

log = logging.getLogger(__name__)

FORMAT = 2  # 2: model and optimizer state through DCP (state/), any world size can resume it


MANIFEST = "manifest.json"

STATE = "state"  # the DCP directory of model and optimizer state


PARTIAL = ".partial"

# A step being replaced by a new save of the same step is renamed to this name first, so that a
# complete one of that step exists at every moment of the commit (checkpoint.py's docstring).
ASIDE = ".old"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: the message names it and what is wrong."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are not what its manifest says (missing, truncated, altered) or
    that has no readable manifest: torn by a crash or damaged on disk since."""


class NoIntactCheckpoint(RuntimeError):
    """Checkpoints were found but none is whole: a fault of the disk or of a crash, not of the
    config, so it is retryable (flyscale/cluster/recovery.py); the message names each and why."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk): the message names the directory, and the
    previous checkpoint stands."""

    def __str__(self) -> str:
        return str(self.strerror)  # the line itself, without OSError's "[Errno 28] " before it


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (files created, renamed, removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(data: bytes, path: Path) -> dict[str, Any]:
    """Write `data` to `path` durably through a temporary name; its size and sha256, hashed from
    memory here rather than read back later."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_file(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save `obj` to `path` durably (`write_bytes`); the file's size and sha256."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return write_bytes(buffer.getvalue(), path)


def hash_files(directory: Path, names: Iterable[str], under: str) -> dict[str, dict[str, Any]]:
    """{`under`/name: size and sha256} of the files `names` in `directory`."""
    found = {}
    for name in sorted(names):
        f = directory / name
        found[f"{under}/{name}"] = {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
    return found


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it, or the failures DCP gathered in it) is a full disk."""
    seen: list[BaseException] = [exc]
    while seen:
        e = seen.pop()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):  # torch's C++ writer says it only in words
            return True
        seen.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        seen.extend(v for v in getattr(e, "failures", {}).values() if isinstance(v, BaseException))
    return False


def disk_full(directory: Path, step: int, previous: Path | None) -> CheckpointWriteError:
    """The error of a checkpoint that a full disk cut short, saying what is left and what to do."""
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    stands = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
    return CheckpointWriteError(
        errno.ENOSPC,
        f"checkpoint of step {step} could not be written in {directory}: no space left on device ({free}); "
        f"{stands}. Free space there, or point recovery.checkpoint_dir at a larger volume",
    )


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint directories under `root`, oldest first: every `step-N`, and a
    `step-N.old` where a crash between the renames of a commit left no `step-N` (it is whole)."""
    if not root.is_dir():
        return []
    steps = {p.name: p for p in root.glob("step-*") if p.is_dir() and "." not in p.name}
    for p in root.glob(f"step-*{ASIDE}"):
        if p.is_dir() and p.name.removesuffix(ASIDE) not in steps:
            steps[p.name.removesuffix(ASIDE)] = p
    return [steps[name] for name in sorted(steps)]


def verify(path: Path, strategy: str) -> dict[str, Any]:
    """The manifest of checkpoint `path` once every file it names is whole; CheckpointError if not.

    Checks everything that can be known before loading: the manifest parses, every file is
    there with its size and sha256, and the strategy is this run's. (Any world size: the model
    and optimizer state are DCP's, which reshards on load; reshard.py keeps the rest.)
    """
    manifest = verify_files(path)
    same_strategy(path, manifest, strategy)
    return manifest


def same_strategy(path: Path, manifest: dict[str, Any], strategy: str) -> None:
    """CheckpointError unless checkpoint `path` (its `manifest`) was written by `strategy`."""
    if manifest["strategy"] != strategy:
        raise CheckpointError(
            f"checkpoint {path} was written by strategy {manifest['strategy']!r}, this run uses {strategy!r}"
        )


def verify_files(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path` once every file it names is there, of its size and
    sha256; DamagedCheckpoint naming what is wrong if not (CheckpointError for another format)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise DamagedCheckpoint(f"checkpoint {path} has no {MANIFEST}: it is incomplete or not a flyscale checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedCheckpoint(f"checkpoint {path}: {MANIFEST} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r}; this flyscale reads {FORMAT}")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise DamagedCheckpoint(f"checkpoint {path}: {name} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise DamagedCheckpoint(
                f"checkpoint {path}: {name} is {size} bytes, the manifest says {meta['bytes']} (truncated or "
                "overwritten)"
            )
        if file_sha256(f) != meta["sha256"]:
            raise DamagedCheckpoint(f"checkpoint {path}: {name} does not match its sha256 in the manifest (corrupt)")
    return manifest


def step_of(path: Path) -> int:
    """The step of a checkpoint directory `step-N` (or `step-N.old`, `step-N.partial`)."""
    return int(path.name.split("-")[1].split(".")[0])


def mirrored_checkpoints(restored: Path) -> list[Path]:
    """Checkpoints in what the mirror restored: step directories at its top level. An upload
    cut short lacks its manifest (it is sent last) and is passed over with a warning."""
    found = []
    for p in sorted(restored.glob("step-*")):
        if p.is_dir() and "." not in p.name:
            if (p / MANIFEST).is_file():
                found.append(p)
            else:
                log.warning(
                    "checkpoint %s from the previous attempt has no manifest (its upload was cut short); "
                    "passing over it",
                    p,
                )
    return found


def tensor_difference(saved: list[list], built: list[list], where: str = "the checkpoint") -> str:
    """The first tensor, by name, whose [name, shape, dtype] differs between `saved` and `built`."""
    a, b = {s[0]: s[1:] for s in saved}, {s[0]: s[1:] for s in built}
    describe = lambda v: f"{v[1].removeprefix('torch.')} {v[0]}" if v else "absent"  # noqa: E731
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return f"{name} is {describe(a.get(name))} in {where} and {describe(b.get(name))} in this model"
    return "the same tensors in another order"


def chosen_checkpoint(path: Path) -> Path:
    """The checkpoint `recovery.resume_from` names: a step-* directory, or the newest complete one
    of a run directory; CheckpointError naming the path when there is none."""
    if (path / MANIFEST).is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"recovery.resume_from {str(path)!r} is no checkpoint and holds none (`flyscale checkpoints` lists them)"
        )
    return found[-1]
