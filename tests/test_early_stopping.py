"""Early stopping: training stops once the validation metric has not improved for `patience`
epochs, on every rank together, and hands on the best epoch's weights, judged against the
metrics history; the kept weights survive a checkpoint and a resume (also resharded)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from flyscale.config import ConfigError, EarlyStoppingConfig, ModelConfig, PipelineConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train import early_stop, trainer
from flyscale.train.batches import TrainData
from flyscale.train.checkpoint import Checkpointer
from flyscale.train.distributed import DistContext, process_group
from flyscale.train.loop import Hooks
from flyscale.train.telemetry import EpochMetrics
from flyscale_plugins.datasets import digits
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.fsdp import FSDPOptions, fsdp
from tests.distributed_helpers import run_on_ranks

# 60 training rows and a wide MLP: the validation loss bottoms out after a few epochs, then rises.
CFG = TrainConfig(epochs=40, batch_size=10, lr=1e-2, seed=0, early_stopping=EarlyStoppingConfig(patience=3))
MODEL = ModelConfig(options={"hidden": [256], "dropout": 0.0})


def _data(train_rows: int = 60) -> TrainData:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    return TrainData(x[:train_rows], y[:train_rows], x[1000:1300], y[1000:1300])


def _model(meta: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(MODEL, digits.info(None), meta=meta)


def _val_loss(model: torch.nn.Module) -> float:
    data = _data()
    with torch.no_grad():
        return float(F.cross_entropy(model.eval()(data.x_val), data.y_val))


def _epochs(values: list[float], metric: str = "val_loss") -> list[EpochMetrics]:
    return [
        EpochMetrics(i, 0.0, None, **{"val_loss": 0.0, "val_accuracy": 0.0, metric: v}, seconds=1, samples_per_s=1)
        for i, v in enumerate(values)
    ]


def test_the_verdict_follows_the_metrics_direction_patience_and_min_delta():
    loss = EarlyStoppingConfig(patience=2)
    assert early_stop.judge(_epochs([1.0, 0.8, 0.9, 0.85]), loss) == early_stop.Verdict(1, 2, True)
    assert early_stop.judge(_epochs([1.0, 0.8, 0.9, 0.7]), loss) == early_stop.Verdict(3, 0, False)
    # An improvement no larger than min_delta is no improvement.
    assert early_stop.judge(_epochs([1.0, 0.95, 0.92]), EarlyStoppingConfig(patience=2, min_delta=0.1)).stop
    accuracy = EarlyStoppingConfig(metric="val_accuracy", patience=1)
    assert early_stop.judge(_epochs([0.4, 0.29], "val_accuracy"), accuracy) == early_stop.Verdict(0, 1, True)


def test_bad_early_stopping_config_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="train.early_stopping.metric must be one of"):
        PipelineConfig.from_dict({"train": {"early_stopping": {"metric": "val_acc"}}})
    with pytest.raises(ConfigError, match=r"train.early_stopping.patience must be > 0"):
        PipelineConfig.from_dict({"train": {"early_stopping": {"patience": 0}}})
    with pytest.raises(ConfigError, match="early_stopping"):
        PipelineConfig.from_dict({"train": {"early_stopping": {"patient": 3}}})


@pytest.fixture(scope="module")
def uninterrupted():
    return trainer.train(ddp, _model(), _data(), CFG, DistContext(), DDPOptions())


def test_an_overfitting_run_stops_early_and_hands_on_the_best_epochs_weights(uninterrupted):
    h = uninterrupted.history
    losses = [m.val_loss for m in h.epochs]
    best = losses.index(min(losses))
    assert len(h.epochs) == best + 1 + CFG.early_stopping.patience < CFG.epochs  # stopped, patience after the best
    assert h.kept_epoch == best + 1 and f"kept epoch {best + 1}'s weights" in h.stopping
    assert f"stopped after epoch {len(h.epochs)} of {CFG.epochs}" in h.stopping
    # The model handed on is the best epoch's: its validation loss is that epoch's, not the last's.
    assert _val_loss(uninterrupted.model) == pytest.approx(losses[best], rel=1e-5)
    assert losses[-1] > losses[best] * 1.01


class _Stop(Exception):
    pass


def test_a_resumed_run_keeps_the_best_epoch_it_had_checkpointed(tmp_path, uninterrupted):
    """Killed after the best epoch and before the stop, the run resumes with the kept weights from
    its checkpoint and ends as the uninterrupted run did: same epochs, same weights handed on."""
    kept = uninterrupted.history.kept_epoch

    def stop_after(m: EpochMetrics) -> None:
        if m.epoch + 1 == kept + 1:  # one epoch past the best: the best lives only in the checkpoint
            raise _Stop

    def checkpointer() -> Checkpointer:
        return Checkpointer(tmp_path / "ckpt", every_steps=1, keep=1, global_batch=CFG.batch_size)

    with pytest.raises(_Stop):
        trainer.train(
            ddp, _model(), _data(), CFG, DistContext(), DDPOptions(), Hooks(checkpointer(), on_epoch=(stop_after,))
        )
    resumed = trainer.train(ddp, _model(), _data(), CFG, DistContext(), DDPOptions(), Hooks(checkpointer()))
    assert resumed.history.resumed_from_step > 0
    assert [m.val_loss for m in resumed.history.epochs] == pytest.approx(
        [m.val_loss for m in uninterrupted.history.epochs], rel=1e-6
    )
    assert resumed.history.kept_epoch == kept
    for name, want in uninterrupted.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], want, msg=name)


def _fsdp_rank(root: str):
    with process_group(timeout_s=60) as ctx:
        per_worker = CFG.batch_size // 2
        ckpt = Checkpointer(Path(root), every_steps=2, keep=1, global_batch=ctx.world_size * per_worker)
        cfg = dataclasses.replace(CFG, strategy="fsdp", batch_size=per_worker)
        result = trainer.train(fsdp, _model(meta=True), _data(), cfg, ctx, FSDPOptions(), Hooks(ckpt))
        h = result.history
        kept = _val_loss(result.model) if ctx.is_main else None
        return [m.val_loss for m in h.epochs], h.kept_epoch, kept


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_sharded_ranks_stop_together_and_rank_zero_gathers_the_best_epoch(tmp_path, world):
    """fsdp on 2 and 3 ranks: each keeps its own shards of the best epoch (checkpointed through
    DCP), every rank stops at the same epoch, and the model rank 0 gathers is the best epoch's."""
    (losses, kept, val), *others = run_on_ranks(_fsdp_rank, world, str(tmp_path / "ckpt"), timeout=150)
    for other_losses, other_kept, _ in others:  # every rank saw the same epochs and stopped together
        assert losses == other_losses and kept == other_kept
    best = losses.index(min(losses))
    assert kept == best + 1 and len(losses) == kept + CFG.early_stopping.patience < CFG.epochs
    assert val == pytest.approx(losses[best], rel=1e-5)
