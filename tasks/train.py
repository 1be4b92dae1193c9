"""Training stage: distributed workers (torch-elastic locally, a PyTorchJob on a cluster)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from flytekit import Deck, Resources, task
from flytekit.types.file import FlyteFile

from flyscale import artifacts, data, distributed, report
from flyscale.caching import code_cache
from flyscale.config import ModelConfig, TrainConfig
from flyscale.contracts import DatasetInfo
from flyscale.preflight import PreflightReport
from flyscale.provenance import TaskRun
from flyscale.shards import Shards
from flyscale.training import TrainHistory
from tasks.common import IMAGE
from tasks.elastic import launcher_facts, training_launcher

Trained = NamedTuple("Trained", [("weights", FlyteFile), ("history", TrainHistory), ("run", TaskRun)])


@task(
    task_config=training_launcher(),
    # The launcher decides the global batch, so the same inputs on other workers are another model.
    cache=code_cache("models", "strategies", facts={"launcher": launcher_facts}),
    container_image=IMAGE,
    requests=Resources(cpu="2", mem="4Gi"),
    shared_memory=True,  # DataLoader workers and gloo exchange tensors through /dev/shm
    enable_deck=True,  # rank 0's "Learning curves" Deck; flytekit's Elastic task ships it to the parent
)
def train_model(
    train: Shards,
    val: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    preflight: PreflightReport,  # an input so that training waits for the check; it raised if it failed
) -> Trained:
    """Train with the configured strategy on every worker; rank 0 returns the weights."""
    run = TaskRun.start("train_model")
    with distributed.process_group() as ctx:
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = artifacts.build_model(model_cfg, info)
        strategy, options = artifacts.strategy(cfg)
        result = strategy(model, data.train_data_from(train, val, info), cfg, ctx, options)
        if not ctx.is_main:
            return distributed.rank_zero_outputs(ctx, None)  # only rank 0 writes files and outputs
        Deck("Learning curves", report.learning_curves_html(result.history))
        path = artifacts.save_state(result.model, "model.pt")
        return distributed.rank_zero_outputs(ctx, Trained(FlyteFile(path), result.history, run.done()))
