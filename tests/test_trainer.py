"""The trainer around a strategy: the parallelize form, the older form that trains by itself, and
the traits every caller reads through one accessor."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.plugin.registry import contract_problems
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.strategies import StrategyTraits, traits_of
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

CFG = TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=0)


def _data() -> TrainData:
    x = torch.randn(80, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    return TrainData(x[:64], y[:64], x[64:], y[64:])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


class Plain:
    """The least a strategy in the parallelize form says: its name and the module."""

    def parallelize(self, model, data, cfg, ctx, options):
        return trainer.Parallelized("plain", model)


def test_a_strategy_that_only_names_its_module_trains_as_ddp_alone_does():
    ours = trainer.train(Plain(), _model(), _data(), CFG, DistContext(), None)
    theirs = trainer.train(ddp, _model(), _data(), CFG, DistContext(), DDPOptions())
    assert ours.history.strategy == "plain" and theirs.history.strategy == "ddp"
    assert [m.train_loss for m in ours.history.epochs] == [m.train_loss for m in theirs.history.epochs]
    assert [m.val_loss for m in ours.history.epochs] == [m.val_loss for m in theirs.history.epochs]


def test_a_strategy_of_the_older_form_still_trains_by_itself_and_is_told_of_the_new_one(caplog):
    seen = []

    def older(model, data, cfg, ctx, options, hooks):
        seen.append(hooks)
        return trainer.train(ddp, model, data, cfg, ctx, DDPOptions(), hooks)

    hooks = trainer.Hooks(on_epoch=(lambda m: None,))
    with caplog.at_level(logging.INFO, logger="flyscale.train.trainer"):
        result = trainer.train(older, _model(), _data(), CFG, DistContext(), None, hooks)
    assert seen == [hooks] and len(result.history.epochs) == 2
    assert "the parallelize form is preferred" in caplog.text


def test_traits_come_from_the_record_a_look_alike_or_the_older_loose_attributes():
    assert traits_of(ddp) == StrategyTraits(per_worker_batch=True, reshards=True)
    assert traits_of(Plain()) == StrategyTraits()
    look_alike = SimpleNamespace(traits=SimpleNamespace(per_worker_batch=False, meta_model=True, reshards=False))
    assert traits_of(look_alike) == StrategyTraits(per_worker_batch=False, meta_model=True)
    older = SimpleNamespace(per_worker_batch=False, reshards=True)
    assert traits_of(older) == StrategyTraits(per_worker_batch=False, reshards=True)


@pytest.mark.parametrize(
    "plugin,problem",
    [
        (Plain(), None),
        (lambda model, data, cfg, ctx, options, hooks: None, None),
        (SimpleNamespace(), "has no method parallelize(model, data, cfg, ctx, options)"),
        (SimpleNamespace(parallelize=lambda model: None), "has parallelize(model), not parallelize(model, data"),
    ],
)
def test_the_registry_takes_either_form_and_refuses_neither(plugin, problem):
    problems = contract_problems("strategies", plugin)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems
