"""A run's checkpoint to Hugging Face safetensors and back: the model's weights, whole, whatever
number of ranks saved their shards (DCP reads each tensor back from the pieces the ranks wrote),
and a folder of safetensors back into a DCP directory that any number of ranks can load from.

    flyscale checkpoints --to-safetensors STEP_DIR --out DIR   # DIR: model-*.safetensors + index
    flyscale checkpoints --from-safetensors DIR --out STATE    # STATE: a DCP directory {"model": ...}

Only the model travels: the optimizer's state and the run's position stay in the checkpoint.
Both ways are one process and need no process group.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flyscale.train.checkpoint_files import STATE, CheckpointError

MODEL = "model"  # the DCP state's key of the model's tensors (TrainState.sharded_state)

# One process on purpose: DCP says so each time it finds no process group.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _allocated(metadata: Metadata, prefix: str) -> dict[str, torch.Tensor]:
    """An empty tensor, whole, for each tensor the checkpoint holds under `prefix`."""
    return {
        fqn.removeprefix(prefix): torch.empty(m.size, dtype=m.properties.dtype)
        for fqn, m in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors, whole, from a step directory (or its `state/` DCP directory)."""
    state_dir = checkpoint / STATE if (checkpoint / STATE).is_dir() else checkpoint
    if not (state_dir / ".metadata").is_file():
        raise CheckpointError(f"{checkpoint}: not a checkpoint step directory (no {STATE}/.metadata)")
    reader = dcp.FileSystemReader(str(state_dir))
    tensors = _allocated(reader.read_metadata(), f"{MODEL}.")
    if not tensors:
        raise CheckpointError(f"{checkpoint}: the checkpoint holds no model tensors")
    state = {MODEL: tensors}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state[MODEL]


def to_safetensors(checkpoint: Path, out: Path) -> list[Path]:
    """The model of `checkpoint` as Hugging Face safetensors in `out` (shards and their index)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors = model_tensors(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(out)), no_dist=True)
    return sorted(out.glob("*.safetensors"))


def from_safetensors(folder: Path, out: Path) -> Path:
    """A DCP directory at `out` holding {"model": the tensors of the safetensors in `folder`}."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder}: no .safetensors files")
    reader = HuggingFaceStorageReader(str(folder))
    tensors = _allocated(reader.read_metadata(), "")
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    dcp.save({MODEL: tensors}, checkpoint_id=str(out), no_dist=True)
    return out
