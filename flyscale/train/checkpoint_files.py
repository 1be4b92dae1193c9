"""A checkpoint on disk: its directory, its files and their manifest, and the checks that a
checkpoint is whole and this run's before anything is loaded (the layout is checkpoint.py's
docstring). No ranks here: `Checkpointer` decides who writes what.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from flyscale.model import file_sha256

log = logging.getLogger(__name__)

FORMAT = 2  # 2: model and optimizer state through DCP (state/), any world size can resume it


MANIFEST = "manifest.json"


PARTIAL = ".partial"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: the message names it and what is wrong."""


def write_file(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save to `path` through a temporary name; the file's size and sha256."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(PARTIAL))


def verify(path: Path, strategy: str) -> dict[str, Any]:
    """The manifest of checkpoint `path` once every file it names is whole; CheckpointError if not.

    Checks everything that can be known before loading: the manifest parses, every file is
    there with its size and sha256, and the strategy is this run's. (Any world size: the model
    and optimizer state are DCP's, which reshards on load; reshard.py keeps the rest.)
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete or not a flyscale checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r}; this flyscale reads {FORMAT}")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} is {size} bytes, the manifest says {meta['bytes']} (truncated or "
                "overwritten)"
            )
        if file_sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 in the manifest (corrupt)")
    if manifest["strategy"] != strategy:
        raise CheckpointError(
            f"checkpoint {path} was written by strategy {manifest['strategy']!r}, this run uses {strategy!r}"
        )
    return manifest


def step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def mirrored_checkpoints(restored: Path) -> list[Path]:
    """Checkpoints in what the mirror restored: step directories at its top level. An upload
    cut short lacks its manifest (it is sent last) and is passed over with a warning."""
    found = []
    for p in sorted(restored.glob("step-*")):
        if p.is_dir() and not p.name.endswith(PARTIAL):
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
