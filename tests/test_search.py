"""The search's parts: its config refuses what cannot be searched, naming it; the study asks the
same trials again for the same seed (what lets the cache replay a rerun), starting from the
base config; the median pruner stops a trial that is behind; the best trial is a finished one;
and training stops on every rank when a trial is pruned. The whole search through `pyflyte run`
is tests/test_experiments_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flyscale.config import ConfigError, TrainConfig
from flyscale.search import study
from flyscale.search.config import SearchStudyConfig
from flyscale.search.study import TrialResult, TrialSpec
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import process_group
from flyscale.train.loop import Hooks
from flyscale.train.telemetry import EpochMetrics, TrainHistory
from flyscale_plugins.datasets import digits
from flyscale_plugins.models import MLP, MLPOptions
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from tests.distributed_helpers import run_on_ranks

SPACE = {
    "train.lr": {"low": 1e-4, "high": 1e-1, "log": True},
    "train.batch_size": {"low": 16, "high": 128, "step": 16},
    "model.options.hidden": {"choices": [[64], [256, 128]]},
}


def _cfg(**search) -> SearchStudyConfig:
    return SearchStudyConfig.from_dict({"search": {"space": SPACE, **search}})


@pytest.mark.parametrize(
    "space,message",
    [
        ({"data.val_fraction": {"low": 0.1, "high": 0.3}}, "'data.val_fraction' is not searched: every trial shares"),
        ({"model.options.hiden": {"choices": [[8]]}}, "model.options.hiden: unknown option; did you mean 'hidden'"),
        ({"train.lr": {"low": 0.0, "high": 1.0, "log": True}}, "a log range needs low > 0"),
        ({"train.lr": {"low": 0.1, "high": 1.0, "choices": [1]}}, "either low and high, or choices"),
        ({"train.epochs": {"low": 0, "high": 3}}, "search.space.train.epochs: train.epochs = 0 gives a bad config"),
        ({}, "search.space is empty"),
    ],
)
def test_a_space_that_cannot_be_searched_is_refused_naming_the_field(space, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SearchStudyConfig.from_dict({"search": {"space": space}})


def _ask(tmp_path: Path, cfg: SearchStudyConfig, name: str, count: int) -> list[TrialSpec]:
    storage = study.storage_url(cfg.search, tmp_path)
    study.create(cfg, name, storage)
    return study.ask(cfg, name, storage, count, "")


def test_the_same_study_asks_the_same_trials_the_first_being_the_base_config(tmp_path):
    cfg = _cfg(trials=4, seed=3)
    first, again = _ask(tmp_path, cfg, "s@1", 4), _ask(tmp_path, cfg, "s@2", 4)
    assert [t.params for t in first] == [t.params for t in again]  # what lets a rerun come from the cache
    assert first[0].params == {"train.lr": "0.002", "train.batch_size": "32", "model.options.hidden": "[256, 128]"}
    configs = [study.trial_config(cfg, t) for t in first]
    assert all(isinstance(c.train.batch_size, int) and c.train.batch_size % 16 == 0 for c in configs)
    assert all(c.model.plugin.options.hidden in ([64], [256, 128]) for c in configs)
    assert len({c.train.lr for c in configs}) == 4
    assert first[1].key() == "s#1" and TrialSpec(study="s@1", number=1, pruner="none").key() == ""
    assert _ask(tmp_path, _cfg(trials=4, seed=4), "s@3", 4)[1].params != first[1].params  # another seed


def _history(values: list[float]) -> TrainHistory:
    return TrainHistory("ddp", 1, epochs=[EpochMetrics(i, 1.0, None, v, 0.5, 1.0, 1.0) for i, v in enumerate(values)])


def test_the_median_pruner_stops_a_trial_behind_the_finished_ones_after_warm_up(tmp_path):
    cfg = _cfg(trials=4, startup_trials=2, warmup_epochs=1, include_base=False)
    specs = _ask(tmp_path, cfg, "p@1", 4)
    opened = study.load("p@1", specs[0].storage, specs[0].storage_env, cfg.search)
    for spec in specs[:2]:
        study.tell(opened, spec, _history([1.0, 0.5, 0.3]), replayed=True)  # reported at tell, as a replay is
    report = study.reporter(specs[2])
    assert report(EpochMetrics(0, 1.0, None, 2.0, 0.5, 1.0, 1.0)) == ""  # epoch 1 is warm-up: never pruned
    said = report(EpochMetrics(1, 1.0, None, 0.9, 0.5, 1.0, 1.0))
    assert said.startswith("pruned by the search after epoch 2: val_loss 0.9000 is behind the median")
    assert study.reporter(specs[3])(EpochMetrics(1, 1.0, None, 0.4, 0.5, 1.0, 1.0)) == ""  # ahead: goes on


def test_the_best_trial_is_a_finished_one():
    made = [
        TrialResult(0, {}, "complete", 0.5, 3, ""),
        TrialResult(1, {}, "pruned", 0.1, 1, ""),
        TrialResult(2, {}, "complete", 0.3, 3, ""),
    ]
    assert study.best(made, "minimize").number == 2 and study.best(made, "maximize").number == 0
    with pytest.raises(ValueError, match="every trial of the search was pruned"):
        study.best([made[1]], "minimize")


def _prune_at_two(m: EpochMetrics) -> str:
    return "pruned by the search after epoch 2" if m.epoch == 1 else ""


def _train_pruned() -> tuple[list[int], str]:
    """A trial's training as tasks/train.py hands it its hooks: the study's reporter on rank 0 alone."""
    torch.manual_seed(0)
    x, y = torch.rand(96, 64) * 16, torch.randint(0, 10, (96,))
    model = MLP().build(MLPOptions(hidden=[32], dropout=0.0), digits.info(None))
    with process_group(timeout_s=30) as ctx:
        hooks = Hooks(stop=_prune_at_two if ctx.is_main else None)
        cfg = TrainConfig(epochs=6, batch_size=16)
        result = trainer.train(ddp, model, TrainData(x[:64], y[:64], x[64:], y[64:]), cfg, ctx, DDPOptions(), hooks)
    return [m.epoch for m in result.history.epochs], result.history.stopping


# The default 2 workers, and 3: a pruning decision made on rank 0 alone once left the others
# waiting in a collective rank 0 never entered.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_a_pruned_trial_stops_training_there_on_every_rank_and_says_why(world):
    for epochs, stopping in run_on_ranks(_train_pruned, world, timeout=90):
        assert epochs == [0, 1]
        assert stopping == "pruned by the search after epoch 2"


def test_a_cluster_search_needs_a_storage_every_pod_reaches(tmp_path):
    cfg = _cfg()
    assert study.storage_url(cfg.search, tmp_path).startswith("sqlite:///")
    with pytest.raises(ValueError, match="search.storage_env is not set, and on a cluster each trial trains in a pod"):
        study.storage_url(cfg.search, tmp_path, local=False)
    shared = _cfg(storage="postgresql://optuna@db/optuna")  # no password: it may stay literal
    assert study.storage_url(shared.search, tmp_path, local=False) == "postgresql://optuna@db/optuna"


def test_a_storage_password_stays_in_its_variable(tmp_path, monkeypatch):
    """A URL with a password is refused in config; by name, only the name reaches a trial, and
    the value is read where the study is opened."""
    with pytest.raises(ConfigError, match="search.storage holds a password.*search.storage_env: OPTUNA_STORAGE"):
        _cfg(storage="postgresql://optuna:hunter2@db/optuna")
    with pytest.raises(ConfigError, match="must name an environment variable"):
        _cfg(storage_env="postgresql://optuna:hunter2@db/optuna")
    cfg = _cfg(storage_env="FLYSCALE_TEST_STORAGE")
    monkeypatch.delenv("FLYSCALE_TEST_STORAGE", raising=False)
    with pytest.raises(ValueError, match="names FLYSCALE_TEST_STORAGE, which is not set in this task's environment"):
        _ask(tmp_path, cfg, "by-name@1", 1)
    secret_place = tmp_path / "hunter2-secret-place"
    secret_place.mkdir()
    monkeypatch.setenv("FLYSCALE_TEST_STORAGE", f"sqlite:///{secret_place / 'studies.db'}")
    specs = _ask(tmp_path, cfg, "by-name@1", 2)
    assert (secret_place / "studies.db").is_file()  # the study is where the variable says
    assert all((s.storage, s.storage_env) == ("", "FLYSCALE_TEST_STORAGE") for s in specs)
    assert "hunter2" not in repr(specs) and "hunter2" not in repr(cfg)
    assert study.load("by-name@1", specs[0].storage, specs[0].storage_env, cfg.search).trials
