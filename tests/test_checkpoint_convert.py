"""A run's sharded checkpoint to Hugging Face safetensors and back (`flyscale convert`): two ranks
each write their FSDP2 shards through DCP, as training does; the model comes out whole, as
safetensors, and goes back into a DCP directory without a changed bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flyscale.train.checkpoint_convert import model_tensors
from tests.distributed_helpers import run_on_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 3, bias=False))


def _save_sharded(state_dir: str) -> list[str]:
    """On each rank: the model sharded by FSDP2 and saved as a step's `state/` is (model and optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from flyscale.train.distributed import process_group

    with process_group(timeout_s=60):
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        weights, optim = get_state_dict(model, optimizer)
        dcp.save({"model": weights, "optimizer": {"state": optim["state"]}}, checkpoint_id=state_dir)
        return sorted(type(v).__name__ for v in weights.values())


def _flyscale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "flyscale"), "convert", *args], capture_output=True, text=True, timeout=120
    )


def test_a_sharded_checkpoint_goes_to_safetensors_and_back_without_a_changed_bit(tmp_path):
    from safetensors.torch import load_file

    step = tmp_path / "step-000000001"
    kinds = run_on_ranks(_save_sharded, 2, str(step / "state"))
    assert kinds[0] == ["DTensor"] * 3  # each rank held only its shards
    assert sorted(p.name for p in (step / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The optimizer stepped the weights: compare with what was saved, read back whole.
    saved = model_tensors(step)
    assert sorted(saved) == ["0.bias", "0.weight", "2.weight"]
    assert not torch.equal(saved["0.weight"], _model()[0].weight.detach())

    done = _flyscale(str(step), "--to", "safetensors", "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() and files
    as_hf = {k: v for f in files for k, v in load_file(str(f)).items()}
    back = _flyscale(str(tmp_path / "hf"), "--to", "dcp", "--out", str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr[-2000:]
    again = model_tensors(tmp_path / "back")
    for name, tensor in saved.items():
        for other in (as_hf[name], again[name]):
            assert other.dtype == tensor.dtype and torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), name
    # A folder that is no checkpoint is named, in one line.
    wrong = _flyscale(str(tmp_path), "--to", "safetensors", "--out", str(tmp_path / "x"))
    assert wrong.returncode == 2 and "not a checkpoint step directory" in wrong.stderr, wrong.stderr
