"""Checkpoints: the whole training state, written atomically, found again after any restart.

A checkpoint is a directory `step-000000123/` holding

    rank-<r>.pt     every rank: its place in the data (epoch, batch, the epoch's partial sums)
                    and its RNG states (Python, numpy, torch, CUDA)
    state-<r>.pt    model, optimizer, LR scheduler and grad scaler: written by every rank when
                    the strategy shards them (a pipeline stage per rank), by rank 0 alone when
                    every rank holds the same (DDP)
    manifest.json   written last, by rank 0: the step, the world size, the strategy, and each
                    file's size, sha256 and the shapes of what it holds

Every file is written under a `.partial` directory that is renamed into place only when all
ranks have written theirs, so a directory without `.partial` is complete or was damaged
afterwards. Damage (a missing, truncated or altered file) and incompatibility (another model,
another world size) are found from the manifest before anything is loaded, and refused with
the path and what is wrong. Files are read with `torch.load(weights_only=True)`: no pickle.

Two kinds of restart find them:
- torch-elastic restarting the worker group inside one Flyte attempt, which reads the local
  restart directory (keyed by run, so concurrent runs never meet);
- Flyte retrying the task, which restores what the previous attempt uploaded through Flyte's
  checkpoint API (a `Mirror`, given by the training task; this module knows nothing of Flyte).

Ranks come only from the DistContext; the files are written by the ranks that own them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from flyscale.artifacts import file_sha256
from flyscale.distributed import DistContext

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
PARTIAL = ".partial"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: the message names it and what is wrong."""


class Mirror(Protocol):
    """A second home for checkpoints that outlives this attempt (Flyte's checkpoint API)."""

    def restore(self) -> Path | None:
        """A local directory holding what an earlier attempt saved, or None."""

    def save(self, checkpoint: Path) -> None:
        """Copy the complete checkpoint directory `checkpoint` there."""


@dataclass
class TrainState:
    """What a strategy hands `fit` so that training can be checkpointed and resumed.

    `module` is this rank's part of the model: the whole model for DDP, its stage for the
    pipeline strategy (`sharded`), whose optimizer then holds only that stage's state.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    sharded: bool = False

    def signature(self) -> list[list]:
        """[name, shape, dtype] of every tensor in the module's state: what 'the same model' means."""
        return [[k, list(v.shape), str(v.dtype)] for k, v in self.module.state_dict().items()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, `batch` batches into epoch `epoch`."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    # This rank's sums over the batches of `epoch` done so far, so a resumed epoch reports what
    # an uninterrupted one would: per-step losses, hits, rows, data-wait and busy seconds.
    losses: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    rows: int = 0
    wait: float = 0.0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # the finished epochs' metrics (rank 0's)


@dataclass
class Resumed:
    """What a resume restored, for the history and the tests: from which step, from where."""

    step: int
    source: str  # "local" (the restart directory) or "mirror" (the previous Flyte attempt)
    path: str


def rng_state() -> dict[str, Any]:
    """Every RNG training may draw from, in a form `weights_only` loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(value):
    # random.setstate wants the tuples it gave; a round trip may hand back lists.
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _write(obj: Any, path: Path) -> dict[str, Any]:
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


def verify(path: Path, world_size: int, strategy: str) -> dict[str, Any]:
    """The manifest of checkpoint `path` once every file it names is whole; CheckpointError if not.

    Checks everything that can be known before loading: the manifest parses, every file is
    there with its size and sha256, and the world size and strategy are this run's.
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
                f"checkpoint {path}: {name} is {size} bytes, the manifest says {meta['bytes']} (truncated or overwritten)"
            )
        if file_sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 in the manifest (corrupt)")
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {manifest['world_size']} workers and this run has {world_size}; "
            f"its per-rank data positions and shards do not carry over. Run with "
            f"FLYSCALE_NPROC_PER_NODE={manifest['world_size']}, or start afresh (recovery.resume: false)"
        )
    if manifest["strategy"] != strategy:
        raise CheckpointError(
            f"checkpoint {path} was written by strategy {manifest['strategy']!r}, this run uses {strategy!r}"
        )
    return manifest


class Checkpointer:
    """Saves this rank's share of the training state on schedule, and restores the newest one.

    Every rank calls every method (they contain collectives); only the files a rank owns are
    written by it, and only rank 0 writes the manifest, renames, prunes and mirrors.
    """

    def __init__(self, root: Path, *, every_steps: int = 0, every_minutes: float = 0.0, keep: int = 2,
                 resume: bool = True, mirror: Mirror | None = None, check_every: int = 16):
        self.root, self.every_steps, self.every_seconds = Path(root), every_steps, every_minutes * 60
        self.keep, self.resume, self.mirror, self.check_every = keep, resume, mirror, check_every
        self._last_save = time.monotonic()
        self.saved: list[int] = []  # steps this process checkpointed
        self.seconds_saving = 0.0  # wall time spent writing, on this rank

    # -- saving -------------------------------------------------------------------------------

    def due(self, step: int, ctx: DistContext) -> bool:
        """Whether to checkpoint after optimizer step `step`; the same answer on every rank.

        By steps, every rank knows. By time, ranks' clocks differ, so every `check_every`
        steps they agree with one small all-reduce (any rank past the interval means all save).
        """
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_seconds or step % self.check_every:
            return False
        late = time.monotonic() - self._last_save >= self.every_seconds
        return ctx.all_reduce_sum([float(late)])[0] > 0

    def save(self, state: TrainState, position: Position, ctx: DistContext, strategy: str) -> Path:
        """Write checkpoint `position.step` from every rank; returns its directory."""
        start = time.perf_counter()
        final = step_dir(self.root, position.step)
        partial = final.with_name(final.name + PARTIAL)
        if ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # a save cut short by an earlier crash
            partial.mkdir(parents=True)
        ctx.barrier()
        files = {}
        if state.sharded or ctx.is_main:
            own = {**state.state_dict(), "signature": state.signature()}
            files[f"state-{ctx.rank}.pt"] = {**_write(own, partial / f"state-{ctx.rank}.pt"),
                                             "signature": hashlib.sha256(json.dumps(own["signature"]).encode()).hexdigest()}
        rank_file = {"position": _position_dict(position), "rng": rng_state()}
        files[f"rank-{ctx.rank}.pt"] = _write(rank_file, partial / f"rank-{ctx.rank}.pt")
        everyone = ctx.all_gather_object(files)  # also: every rank has written its files
        if ctx.is_main:
            manifest = {
                "format": FORMAT, "step": position.step, "epoch": position.epoch, "batch": position.batch,
                "world_size": ctx.world_size, "strategy": strategy, "sharded": state.sharded,
                "written_at": time.time(), "files": {k: v for part in everyone for k, v in part.items()},  # type: ignore[union-attr]
            }
            tmp = partial / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, partial / MANIFEST)
            if final.exists():  # the same step saved before a restart: replace it whole
                shutil.rmtree(final)
            os.rename(partial, final)
            self._prune()
            if self.mirror is not None:
                self.mirror.save(final)
        self._last_save = time.monotonic()
        self.saved.append(position.step)
        self.seconds_saving += time.perf_counter() - start
        return final

    def discard(self) -> None:
        """Delete this run's restart directory: training finished, nothing will resume from it."""
        shutil.rmtree(self.root, ignore_errors=True)

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- resuming -----------------------------------------------------------------------------

    def restore(self, state: TrainState, ctx: DistContext, strategy: str) -> tuple[Position, Resumed] | None:
        """Load the newest checkpoint of this run into `state`: from the local restart directory,
        or from the mirror (the previous Flyte attempt) where that holds a newer one.

        None when there is none (or `resume` is off). A damaged or incompatible newest one
        raises CheckpointError on every rank instead of being passed over, so a resume never
        quietly goes back further than the user expects, or starts from zero.
        """
        if not self.resume:
            return None
        choice: tuple[str, str, str] | None = None
        if ctx.is_main:  # one rank chooses, so that every rank loads the same checkpoint
            try:
                found = self._newest()
                if found is not None:
                    verify(found[0], ctx.world_size, strategy)
                    choice = ("ok", str(found[0]), found[1])
            except CheckpointError as exc:
                choice = ("error", str(exc), "")
        choice = ctx.all_gather_object(choice)[0]  # type: ignore[assignment]
        if choice is None:
            return None
        status, where, source = choice
        if status == "error":
            raise CheckpointError(where)
        path = Path(where)
        manifest = json.loads((path / MANIFEST).read_text())
        owner = ctx.rank if manifest["sharded"] else 0
        own = torch.load(path / f"state-{owner}.pt", map_location=ctx.device, weights_only=True)
        if own["signature"] != state.signature():
            raise CheckpointError(
                f"checkpoint {path} holds another model than this run builds: "
                f"{_difference(own['signature'], state.signature())}. "
                f"Start afresh (recovery.resume: false) or train the model it was written for"
            )
        state.load_state_dict(own)
        mine = torch.load(path / f"rank-{ctx.rank}.pt", map_location="cpu", weights_only=True)
        position = Position(**mine["position"])
        self._rng_after_skip = mine["rng"]
        log.info("resuming from checkpoint %s (%s): step %d, epoch %d, batch %d",
                 path, source, position.step, position.epoch + 1, position.batch)
        return position, Resumed(step=position.step, source=source, path=str(path))

    def _newest(self) -> tuple[Path, str] | None:
        """(the newest checkpoint, "local" or "mirror"). A newer one in the mirror is first
        copied into the restart directory, where every rank (on every node, if shared) reads it
        and a later worker restart in this attempt finds it too."""
        local = complete_checkpoints(self.root)
        newest = (local[-1], "local") if local else None
        restored = self.mirror.restore() if self.mirror is not None else None
        mirrored = _mirrored(restored) if restored is not None else []
        if mirrored and (newest is None or _step_of(mirrored[-1]) > _step_of(newest[0])):
            source = mirrored[-1]
            target = self.root / source.name
            partial = target.with_name(target.name + PARTIAL)
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(source, partial)
            os.rename(partial, target)
            newest = (target, "mirror")
        return newest

    def restore_rng(self) -> None:
        """Put back the RNG states of the checkpoint `restore` loaded. Call it once the resumed
        epoch's loader has skipped the batches already done, as the saving run stood then."""
        state = getattr(self, "_rng_after_skip", None)
        if state is not None:
            set_rng_state(state)
            self._rng_after_skip = None


def _position_dict(p: Position) -> dict[str, Any]:
    return {"step": p.step, "epoch": p.epoch, "batch": p.batch, "losses": list(p.losses), "hits": list(p.hits),
            "rows": p.rows, "wait": p.wait, "seconds": p.seconds, "history": list(p.history)}


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def _mirrored(restored: Path) -> list[Path]:
    """Checkpoints in what the mirror restored: step directories at its top level. An upload
    cut short lacks its manifest (it is sent last) and is passed over with a warning."""
    found = []
    for p in sorted(restored.glob("step-*")):
        if p.is_dir() and not p.name.endswith(PARTIAL):
            if (p / MANIFEST).is_file():
                found.append(p)
            else:
                log.warning("checkpoint %s from the previous attempt has no manifest (its upload was cut short); "
                            "passing over it", p)
    return found


def _difference(saved: list[list], built: list[list]) -> str:
    a, b = {s[0]: s[1:] for s in saved}, {s[0]: s[1:] for s in built}
    describe = lambda v: f"{v[1].removeprefix('torch.')} {v[0]}" if v else "absent"  # noqa: E731
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return f"{name} is {describe(a.get(name))} in the checkpoint and {describe(b.get(name))} in this model"
    return "the same tensors in another order"


def run_directory(base: str, execution: str, started_at: float) -> Path:
    """The local restart directory of one run: `base` (or ~/.flyscale/checkpoints) / a key of
    the execution and its start. A restart of the worker group and a retry of the task see the
    same key (the same inputs); two runs, concurrent or not, never share one."""
    root = Path(base).expanduser() if base else Path.home() / ".flyscale" / "checkpoints"
    key = hashlib.sha256(f"{execution}|{started_at!r}".encode()).hexdigest()[:16]
    return root / f"run-{key}"
