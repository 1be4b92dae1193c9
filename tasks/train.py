"""Training stage: distributed workers (torch-elastic locally, a PyTorchJob on a cluster)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from flytekit import Deck, task
from flytekit.types.file import FlyteFile

from flyscale import artifacts, data, distributed, report, tracking, training
from flyscale.caching import code_cache
from flyscale.checkpoint import Checkpointer, run_directory
from flyscale.config import MlflowConfig, ModelConfig, RecoveryConfig, TrainConfig
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint
from flyscale.preflight import PreflightReport
from flyscale.provenance import TaskRun
from flyscale.shards import Shards
from flyscale.training import TrainHistory
from tasks.common import DECKS, TASK
from tasks.elastic import launcher_environment, launcher_facts, training_launcher, training_resources, training_retries
from tasks.recovery import FlyteMirror, lost_peers_retryable

Trained = NamedTuple("Trained", [("weights", FlyteFile), ("history", TrainHistory), ("run", TaskRun)])


@task(
    task_config=training_launcher(),
    # The launcher decides the global batch, so the same inputs on other workers are another model.
    # Where the live curves go (the store, this execution's start and data version) and how the run
    # recovers from failures are no part of the model.
    cache=code_cache("models", "strategies", facts={"launcher": launcher_facts},
                     ignored_inputs=("fingerprint", "started", "mlflow_cfg", "recovery")),
    **TASK,
    **training_resources(),  # per worker process, times the processes per node
    environment=launcher_environment(),  # the pod builds the launcher that was registered
    # Spot nodes are fine: a preempted attempt is retried and resumes from its last checkpoint.
    interruptible=True,
    retries=training_retries(),
    enable_deck=True,  # rank 0's "Learning curves" Deck; flytekit's Elastic task ships it to the parent
    deck_fields=DECKS,
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
    recovery: RecoveryConfig = RecoveryConfig(),
) -> Trained:
    """Train with the configured strategy on every worker; rank 0 returns the weights, and logs
    each epoch to the execution's MLflow run as it ends. Checkpoints as `recovery` says, and
    resumes from the newest one this run wrote (after a worker restart or a Flyte retry)."""
    run = TaskRun.start("train_model")
    with lost_peers_retryable(), distributed.process_group(timeout_s=recovery.collective_timeout_s) as ctx:
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        # On the meta device where the strategy materialises its own part (each pipeline stage its layers).
        model = artifacts.build_model(model_cfg, info, meta=artifacts.wants_meta_model(cfg))
        strategy, options = artifacts.strategy(cfg)
        live = None
        if ctx.is_main:
            name = tracking.run_name(model_cfg.name, cfg.strategy, ctx.world_size, fingerprint.value, started.started_at)
            live = tracking.LiveRun(mlflow_cfg, name, started.started_at, started.execution)
        checkpointer = Checkpointer(
            run_directory(recovery.checkpoint_dir, started.execution, started.started_at),
            every_steps=recovery.checkpoint_every_steps, every_minutes=recovery.checkpoint_every_minutes,
            keep=recovery.keep_checkpoints, resume=recovery.resume,
            mirror=FlyteMirror.current(recovery.keep_checkpoints) if ctx.is_main else None,
        )
        # A failure leaves the live run RUNNING: a restart or a retry carries on with it, and if
        # none succeeds the workflow's failure handler (close_failed_run) ends it FAILED.
        with training.on_epoch(live.epoch if live else lambda m: None), training.checkpointing(checkpointer):
            result = strategy(model, data.train_data_from(train, val, info), cfg, ctx, options)
        if len(result.history.epochs) != cfg.epochs:  # never hand on a model from a run cut short
            raise RuntimeError(f"training ended after {len(result.history.epochs)} of {cfg.epochs} epochs")
        ctx.barrier()  # every rank is past its last checkpoint read or write
        if ctx.is_main:
            checkpointer.discard()  # finished: the weights are the task's output from here on
        if not ctx.is_main:
            return distributed.rank_zero_outputs(ctx, None)  # only rank 0 writes files and outputs
        result.history.mlflow_run_id = live.run_id
        Deck("Learning curves", report.learning_curves_html(result.history))
        path = artifacts.save_state(result.model, "model.pt")
        return distributed.rank_zero_outputs(ctx, Trained(FlyteFile(path), result.history, run.done()))
