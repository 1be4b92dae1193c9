"""Training stage: distributed workers (torch-elastic locally, a PyTorchJob on a cluster)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from flytekit import Deck, Resources, task
from flytekit.types.file import FlyteFile

from flyscale import artifacts, data, distributed, report, tracking, training
from flyscale.caching import code_cache
from flyscale.config import MlflowConfig, ModelConfig, TrainConfig
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint
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
    # Where the live curves go (the store, this execution's start and data version) is no part of the model.
    cache=code_cache("models", "strategies", facts={"launcher": launcher_facts},
                     ignored_inputs=("fingerprint", "started", "mlflow_cfg")),
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
    fingerprint: DataFingerprint,
    started: TaskRun,
    mlflow_cfg: MlflowConfig,
) -> Trained:
    """Train with the configured strategy on every worker; rank 0 returns the weights, and logs
    each epoch to the execution's MLflow run as it ends."""
    run = TaskRun.start("train_model")
    with distributed.process_group() as ctx:
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = artifacts.build_model(model_cfg, info)
        strategy, options = artifacts.strategy(cfg)
        live = None
        if ctx.is_main:
            name = tracking.run_name(model_cfg.name, cfg.strategy, ctx.world_size, fingerprint.value, started.started_at)
            live = tracking.LiveRun(mlflow_cfg, name, started.started_at)
        try:
            with training.on_epoch(live.epoch if live else lambda m: None):
                result = strategy(model, data.train_data_from(train, val, info), cfg, ctx, options)
        except BaseException:
            if live is not None:
                live.failed()
            raise
        if not ctx.is_main:
            return distributed.rank_zero_outputs(ctx, None)  # only rank 0 writes files and outputs
        result.history.mlflow_run_id = live.run_id
        Deck("Learning curves", report.learning_curves_html(result.history))
        path = artifacts.save_state(result.model, "model.pt")
        return distributed.rank_zero_outputs(ctx, Trained(FlyteFile(path), result.history, run.done()))
