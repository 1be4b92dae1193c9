"""Which checkpoint a resume loads, and the checks of it that need DCP's metadata or the rank.

`newest_whole` chooses: the newest whole checkpoint of the run's own, of `recovery.resume_from`
and of the mirror, passing over damaged ones with a warning (checkpoint.py's docstring). No
ranks here beyond the one a message names: `Checkpointer.restore` has rank 0 choose for all.
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flyscale.train.checkpoint_commit import replace_step
from flyscale.train.checkpoint_files import (
    PARTIAL,
    STATE,
    CheckpointError,
    DamagedCheckpoint,
    NoIntactCheckpoint,
    chosen_checkpoint,
    complete_checkpoints,
    mirrored_checkpoints,
    step_of,
    tensor_difference,
    verify_files,
)

if TYPE_CHECKING:
    from flyscale.train.distributed import DistContext
    from flyscale.train.state import TrainState

log = logging.getLogger(__name__)


def newest_whole(root: Path, resume_from: str, restored: Path | None) -> tuple[Path, str, dict[str, Any]] | None:
    """(the newest whole checkpoint, where it came from, its manifest), or None where there is none.

    Of the run's own under `root`, `resume_from`'s (unless the run has gone further since: a
    worker restart after it) and those in `restored` (what the mirror restored: the previous
    Flyte attempt's), newest first; at one step, the named one, then the run's own. One from the
    mirror is first copied into `root`, where every rank (on every node, if shared) reads it and a
    later worker restart in this attempt finds it too. A damaged one is passed over with a
    warning naming it and what is wrong, and the source then says so; unless `resume_from` names
    it (the user's choice: DamagedCheckpoint). None whole of several: NoIntactCheckpoint.
    """
    found = [(p, "local", 1) for p in complete_checkpoints(root)]
    if resume_from:
        found.append((chosen_checkpoint(Path(resume_from).expanduser()), "recovery.resume_from", 2))
    found += [(p, "mirror", 0) for p in (mirrored_checkpoints(restored) if restored is not None else [])]
    damaged: list[tuple[Path, DamagedCheckpoint]] = []
    for path, source, _ in sorted(found, key=lambda c: (step_of(c[0]), c[2]), reverse=True):
        if source == "mirror":
            path = _copied_in(path, root)
        try:
            manifest = verify_files(path)
        except DamagedCheckpoint as exc:
            if source == "recovery.resume_from":
                raise
            log.warning("%s: passing over it for the newest whole checkpoint before it", exc)
            damaged.append((path, exc))
            continue
        if damaged:
            source = f"{source}; fell back from damaged {', '.join(f'step {step_of(p)}' for p, _ in damaged)}"
            log.warning("resuming from step %d (%s), the newest whole checkpoint", step_of(path), source)
        return path, source, manifest
    if damaged:
        raise NoIntactCheckpoint(
            f"no checkpoint of this run is whole, so it cannot resume: {'; '.join(str(e) for _, e in damaged)}. A "
            f"crash or the disk damaged them; delete {root} (or set recovery.resume: false) to start afresh"
        )
    return None


def _copied_in(source: Path, root: Path) -> Path:
    """The mirror's checkpoint `source`, copied whole into the run directory `root`."""
    target = root / source.name
    partial = target.with_name(target.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    replace_step(partial, target)
    return target


def same_model(path: Path, state: TrainState) -> None:
    """CheckpointError unless the checkpoint holds every tensor this rank's module has, in the same
    shape and dtype (and, for a whole model, no other): from DCP's metadata, before any load."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _metadata(path)
    saved = [
        [k.removeprefix("model."), list(m.size), str(m.properties.dtype)]
        for k, m in metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    ]
    mine = state.signature()
    names = {s[0] for s in mine}
    # A pipeline stage holds some of the model's layers: those, not all, must be there.
    compared = [s for s in saved if s[0] in names] if state.stage else saved
    if sorted(compared) != sorted(mine):
        raise CheckpointError(
            f"checkpoint {path} holds another model than this run builds: "
            f"{tensor_difference(compared, mine)}. "
            f"Start afresh (recovery.resume: false) or train the model it was written for"
        )


def visible(path: Path, name: str, ctx: DistContext) -> Path:
    """`path / name`, or a CheckpointError saying that this rank does not see it where it runs."""
    if not (path / name).is_file():
        raise CheckpointError(
            f"rank {ctx.rank} (host {socket.gethostname()}) cannot see {name} of checkpoint {path}: every rank "
            f"reads its own files from it, so it must be on a volume every node mounts (recovery.checkpoint_dir, "
            f"or recovery.resume_from, on a ReadWriteMany volume at the same path in every training pod)"
        )
    return path / name


def _metadata(path: Path) -> dict:
    """DCP's metadata of a checkpoint's state: each saved key's shape and type, no tensor read."""
    import torch.distributed.checkpoint as dcp  # not at the top: every pyflyte run imports this module; only training needs DCP (and DTensor, sympy)

    return dcp.FileSystemReader(str(path / STATE)).read_metadata().state_dict_metadata


def holds_best(path: Path) -> bool:
    """Whether the checkpoint holds early stopping's kept weights beside the model."""
    metadata = _metadata(path)
    return any(k.startswith("best.") for k in metadata)
