"""Warm starts: every strategy starts from the given weights (its shards of them, or its stage's
layers), not from fresh ones; weights of another architecture or trained on other inputs are
refused, naming the difference. Real gloo ranks. The path from the registry through `pyflyte run`
is tests/test_experiments_e2e.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model, file_sha256
from flyscale.plugin.contracts import DatasetInfo, FieldSpec
from flyscale.tracking.model_spec import spec_json
from flyscale.tracking.start import Fetched, StartError, check
from flyscale.train import meta, trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext, process_group
from flyscale.train.loop import Hooks
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.fsdp import FSDPOptions, fsdp
from flyscale_plugins.strategies.hybrid import HybridOptions, hybrid
from flyscale_plugins.strategies.pipeline import PipelineOptions, pipeline
from tests.distributed_helpers import run_on_ranks

TABLE = DatasetInfo("table", 3, [8], [f"f{i}" for i in range(8)])
MODEL = ModelConfig(options={"hidden": [16, 16], "dropout": 0.0})
# A learning rate of nothing: what training hands on is what it started from.
CFG = TrainConfig(epochs=1, batch_size=8, lr=1e-12, weight_decay=0.0, seed=5)


def _model(on_meta: bool) -> torch.nn.Module:
    return build_model(MODEL, TABLE, meta=on_meta)


def _table() -> TrainData:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g)
    return TrainData(x[:32], y[:32], x[32:], y[32:])


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    """Weights no strategy would draw itself: the MLP's shapes, filled from another generator."""
    g = torch.Generator().manual_seed(99)
    state = {k: torch.randn(v.shape, generator=g) for k, v in _model(on_meta=False).state_dict().items()}
    path = tmp_path_factory.mktemp("start") / "start.pt"
    torch.save(state, path)
    return path


def _assert_started_from(state: dict, start: Path) -> None:
    want = torch.load(start, weights_only=True)
    assert set(state) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_one_process_starts_from_the_weights_and_without_them_from_fresh_ones(start):
    result = trainer.train(
        ddp, _model(on_meta=False), _table(), CFG, DistContext(), DDPOptions(), Hooks(start=str(start))
    )
    _assert_started_from(result.model.state_dict(), start)
    fresh = trainer.train(ddp, _model(on_meta=False), _table(), CFG, DistContext(), DDPOptions())
    with pytest.raises(AssertionError):
        _assert_started_from(fresh.model.state_dict(), start)


def _sharded_and_staged(start: str):
    out = {}
    with process_group(timeout_s=60) as ctx:
        runs = {
            "fsdp": (fsdp, dataclasses.replace(CFG, strategy="fsdp", batch_size=4), FSDPOptions()),
            "pipeline": (pipeline, dataclasses.replace(CFG, strategy="pipeline"), PipelineOptions(microbatches=2)),
        }
        for name, (strategy, cfg, options) in runs.items():
            result = trainer.train(strategy, _model(on_meta=True), _table(), cfg, ctx, options, Hooks(start=start))
            out[name] = {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None
    return out


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_sharded_and_pipelined_ranks_each_load_their_part_of_the_weights(start):
    """fsdp (each rank its shards) and the pipeline (each rank its stage) on 2 ranks: the model rank
    0 assembles at the end is the starting one."""
    out = run_on_ranks(_sharded_and_staged, 2, str(start), timeout=150)[0]
    _assert_started_from(out["fsdp"], start)
    _assert_started_from(out["pipeline"], start)


def _tensor_parallel(start: str):
    with process_group(timeout_s=60) as ctx:
        given = {"mesh": {"dp": 2, "tp": 2}, "tp_plan": {"0": "colwise", "3": "rowwise"}}
        cfg = dataclasses.replace(CFG, strategy="hybrid", batch_size=4, options=given)
        options = HybridOptions(**given)
        result = trainer.train(hybrid, _model(on_meta=True), _table(), cfg, ctx, options, Hooks(start=start))
        return {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_two_dimensional_mesh_loads_its_slices_of_the_weights(start):
    _assert_started_from(run_on_ranks(_tensor_parallel, 4, str(start), timeout=200)[0], start)


def _fetched(path: Path, model: ModelConfig, info: DatasetInfo) -> Fetched:
    torch.save(meta.materialise(build_model(model, info, meta=True), "cpu", 0).state_dict(), path)
    spec = json.loads(spec_json(model, info, None))
    return Fetched(str(path), file_sha256(path), "models:/digits@champion: version 3", spec)


def test_weights_of_another_architecture_are_refused_naming_the_tensor(tmp_path):
    fetched = _fetched(tmp_path / "w.pt", ModelConfig(options={"hidden": [32]}), TABLE)
    with pytest.raises(
        StartError,
        match=r"another architecture than this run builds: 0.bias is float32 \[32\] in the starting weights and "
        r"float32 \[16\] in this model. It is model 'mlp' with options \{'hidden': \[32\]\}",
    ):
        check(fetched, _model(on_meta=True), MODEL, TABLE)
    check(_fetched(tmp_path / "same.pt", MODEL, TABLE), _model(on_meta=True), MODEL, TABLE)  # the same: taken


def test_weights_trained_on_other_inputs_are_refused_naming_them(tmp_path):
    other = dataclasses.replace(TABLE, feature_columns=[f"g{i}" for i in range(8)])
    with pytest.raises(StartError, match=r"other inputs: its 8 feature columns are not this run's 8 \(missing here"):
        check(_fetched(tmp_path / "w.pt", MODEL, other), _model(on_meta=True), MODEL, TABLE)
    images = DatasetInfo("img", 3, [], [], fields=[FieldSpec("image", "uint8", [1, 8, 8])], input_field="image")
    with pytest.raises(StartError, match=r"it read columns of features, this run's data gives field image"):
        check(_fetched(tmp_path / "w2.pt", MODEL, TABLE), _model(on_meta=True), MODEL, images)
