"""Training stage: distributed workers (torch-elastic locally, a PyTorchJob on a cluster)."""

from __future__ import annotations

import logging
from typing import Annotated, NamedTuple

import torch
from flytekit import Deck, task
from flytekit.types.file import FlyteFile

from flyscale.cluster.launcher_settings import (
    launcher_environment,
    launcher_facts,
    processes_per_node,
    training_resources,
    training_retries,
    workers_auto,
)
from flyscale.cluster.launchers import training_launcher
from flyscale.cluster.recovery import FlyteMirror, lost_peers_retryable
from flyscale.config import AugmentConfig, MlflowConfig, ModelConfig, ObjectiveConfig, RecoveryConfig, TrainConfig
from flyscale.config.flatten import flatten
from flyscale.data.augment import on_the_fly
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.flyte.caching import code_cache, code_version
from flyscale.flyte.content import BY_CONTENT, file_sha256
from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped
from flyscale.model import build_model, kept, parameter_counts, save_state
from flyscale.plugin.records import DatasetInfo
from flyscale.render.decks import learning_curves_html
from flyscale.search.study import TrialSpec, reporter
from flyscale.tracking.live import LiveRun
from flyscale.tracking.store import run_name
from flyscale.train import distributed
from flyscale.train import objective as objectives
from flyscale.train.batches import train_data_from
from flyscale.train.checkpoint import Checkpointer
from flyscale.train.interrupt import StopSignals
from flyscale.train.loop import Hooks
from flyscale.train.preflight import PreflightReport, global_batch, keep_global_batch
from flyscale.train.run_dirs import prune, restart_directory, training_key
from flyscale.train.strategies import any_worker_count, per_worker_batch, reshards, strategy, wants_meta_model
from flyscale.train.telemetry import TrainHistory
from flyscale.train.trainer import train as train_with
from tasks.common import DECKS, task_options, tracked
from tasks.records import ModelBundle, StartWeights, keyed

log = logging.getLogger(__name__)


def identity(
    fingerprint: DataFingerprint,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    world_size: int,
    augment: AugmentConfig,
    objective: ObjectiveConfig,
    start_sha256: str = "",
) -> str:
    """The key of what this task trains (what its cache key holds, but for the execution): the
    same command run again after a Ctrl-C or a crash has the same one, and resumes. A strategy
    whose checkpoints reshard (fsdp) leaves the workers out: run again on fewer or more, it
    resumes, resharded."""
    workers = {} if reshards(cfg) else {"launcher": launcher_facts(), "world_size": world_size}
    return training_key(
        {
            "data": fingerprint.value,
            "model": flatten(model_cfg),
            "train": flatten(cfg),
            "augment": flatten(augment),
            "objective": flatten(objective),
            "start": start_sha256,
            **workers,
            "code": code_version(__name__, ("models", "strategies", "objectives")),
        }
    )


def registered_workers(cfg: TrainConfig, preflight: PreflightReport) -> str:
    """How the worker count was set, where FLYSCALE_NPROC_PER_NODE=auto did not choose it."""
    if cfg.workers() is not None:
        return "train.options.mesh"
    if not workers_auto():
        return f"FLYSCALE_NPROC_PER_NODE={processes_per_node()}"
    if not any_worker_count(cfg):
        return f"auto does not choose for strategy {cfg.strategy!r}: its workers are its layout"
    if preflight.workers_reason:
        return f"auto: {preflight.workers_reason}"
    return "auto: the registered count (auto chooses in local runs)"


class TrainedWeights(NamedTuple):
    """What rank 0's training job ends with: the weights' file (a state_dict) and how it went."""

    path: str
    history: TrainHistory


class Trained(NamedTuple):
    model: Annotated[ModelBundle, BY_CONTENT]  # keyed by content downstream: the weights' bytes, not their place
    history: TrainHistory
    run: TaskRun = UNSTAMPED  # filled in by @stamped


# The launcher decides the global batch, so the same inputs on other workers are another model.
# Where the live curves go (the store, this execution's start and data version) and how the run
# recovers from failures are no part of the model. The starting weights enter by their content
# (`start_sha256`), not by the file's fresh path.
# A search's trial enters by its key (`trial_key`: its study and number when it may be pruned),
# not by the storage it reports to, which is new in every execution.
# The preflight enters by what training takes from it, the workers auto chose (`workers`), not by
# the throughputs it measured. The tokenizer (text: handed on in the model's bundle) enters by its
# sha256 (`tokenizer_sha256`).
IGNORED = ("fingerprint", "started", "mlflow_cfg", "recovery", "start", "trial", "preflight", "tokenizer")


def train_job(
    train: Shards,
    val: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    fingerprint: DataFingerprint,
    started: TaskRun,
    mlflow_cfg: MlflowConfig,
    recovery: RecoveryConfig,
    threads: int = 0,
    augment: AugmentConfig = AugmentConfig(),  # noqa: B008 (never mutated)
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (never mutated)
    start: StartWeights = StartWeights(),  # noqa: B008 (never mutated)
    trial: TrialSpec = TrialSpec(),  # noqa: B008 (never mutated)
    preflight: PreflightReport = PreflightReport.skipped(),  # noqa: B008 (never mutated)
) -> TrainedWeights | None:
    """The training job, on every worker: the configured strategy on the model, with this run's
    checkpoints and live MLflow curves as its hooks. Rank 0 returns the trained model; the
    others return None (or, in a classic PyTorchJob pod, tell Flyte their outputs are not the
    task's). `threads` > 0: each worker's torch threads (a scaling study's share). `preflight`:
    where FLYSCALE_NPROC_PER_NODE=auto chose this many workers, the global batch it timed."""
    # A Ctrl-C or a pod's SIGTERM stops every rank after the same step, with one checkpoint there.
    signals = StopSignals()
    with (
        lost_peers_retryable(),
        signals.installed(),
        distributed.process_group(recovery.collective_timeout_s, threads) as ctx,
    ):
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        # On the meta device where the strategy materialises its own part (each pipeline stage its layers).
        model = build_model(model_cfg, info, meta=wants_meta_model(cfg))
        counted = parameter_counts(model)  # before a strategy wraps or shards it
        train_fn, options = strategy(cfg)
        key = identity(fingerprint, model_cfg, cfg, ctx.world_size, augment, objective, start.sha256)
        cfg, workers = keep_global_batch(cfg, preflight, ctx.world_size, registered_workers(cfg, preflight))
        live = None
        if ctx.is_main:
            # A search's trials share the execution: each is named by its number and values.
            name = (
                trial.run_name()
                if trial.study
                else run_name(model_cfg.name, cfg.strategy, ctx.world_size, fingerprint.value, started.started_at)
            )
            tags = {"mlflow.parentRunId": trial.parent_run_id, "flyscale.trial": str(trial.number)}
            live = LiveRun(mlflow_cfg, name, started.started_at, started.execution, tags if trial.study else None)
        if ctx.is_main and recovery.retention_days:  # folders of runs that died or were stopped long ago
            prune(recovery.checkpoint_dir, recovery.retention_days * 86400)
        # Rank 0 claims the run directory; with checkpoints on, every rank proves it sees it (one
        # volume on every node) before anything trains, or all refuse together, saying what to mount.
        checkpoints = recovery.checkpoints()
        owner = f"{started.execution}@{started.started_at!r}"
        with restart_directory(ctx, recovery.checkpoint_dir, key, owner, probe=checkpoints) as root:
            checkpointer = Checkpointer(
                root,
                every_steps=recovery.checkpoint_every_steps,
                every_minutes=recovery.checkpoint_every_minutes,
                keep=recovery.keep_checkpoints,
                resume=recovery.resume,
                resume_from=recovery.resume_from,
                mirror=FlyteMirror.current(recovery.keep_checkpoints) if ctx.is_main else None,
                global_batch=global_batch(train_fn, cfg, ctx.world_size),
                grad_accum_steps=cfg.grad_accum_steps,
                asynchronous=recovery.async_checkpoints,
            )
            plan = checkpointer.reshard_plan(ctx, per_worker_batch(cfg)) if reshards(cfg) else None
            if plan is not None:  # the checkpoint's global batch, on this many workers
                cfg = plan.apply(cfg)
                if ctx.is_main:
                    log.info(
                        "resuming a checkpoint of %d workers on %d: %s", plan.saved_world, plan.world, plan.sentence()
                    )
            # A failure leaves the live run RUNNING: a restart or a retry carries on with it, and if
            # none succeeds the workflow's failure handler (close_failed_run) ends it FAILED.
            hooks = Hooks(
                checkpointer=checkpointer,
                on_epoch=(live.epoch,) if live is not None else (),
                start=start.weights.download() if start.weights is not None else "",
                # A search's trial reports each epoch to its study, which may prune it.
                stop=reporter(trial) if ctx.is_main and trial.key() else None,
                workers_timed=bool(preflight.workers) and ctx.world_size == preflight.workers,
                signals=signals,
            )
            data = train_data_from(train, val, info, on_the_fly(augment, info), objectives.of(objective))
            result = train_with(train_fn, model, data, cfg, ctx, options, hooks)
            finished = len(result.history.epochs) == cfg.epochs or bool(result.history.stopping)
            ctx.barrier()  # every rank is past its last checkpoint read or write
            if ctx.is_main and finished:
                checkpointer.discard()  # the weights are the task's output from here on
        if not finished:  # never hand on a model from a run cut short
            raise RuntimeError(f"training ended after {len(result.history.epochs)} of {cfg.epochs} epochs")
        if not ctx.is_main:
            return distributed.rank_zero_outputs(ctx, None)  # only rank 0 writes files and outputs
        if live is None:  # rank 0 opened it above
            raise RuntimeError("rank 0 has no live MLflow run to hand on")
        result.history.mlflow_run_id = live.run_id
        result.history.workers = workers
        result.history.parameters, result.history.trained_parameters = counted
        if start.weights is not None:
            result.history.started_from = f"{start.source} (weights sha256 {start.sha256[:12]})"
        Deck("Learning curves", learning_curves_html(result.history))
        return TrainedWeights(save_state(result.model, "model.pt"), result.history)


@task(
    task_config=training_launcher(),
    cache=code_cache("models", "strategies", "objectives", facts={"launcher": launcher_facts}, ignored_inputs=IGNORED),
    **tracked(task_options(**launcher_environment())),  # the pod builds the launcher that was registered
    **training_resources(),  # per worker process, times the processes per node
    # Spot nodes are fine: a preempted attempt is retried and resumes from its last checkpoint.
    interruptible=True,
    retries=training_retries(),
    enable_deck=True,  # rank 0's "Learning curves" Deck; flytekit's Elastic task ships it to the parent
    deck_fields=DECKS,
)
@stamped
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
    recovery: RecoveryConfig = RecoveryConfig(),  # noqa: B008 (a Flyte input's default is its value)
    augment: AugmentConfig = AugmentConfig(),  # noqa: B008 (typed examples: each batch as it is drawn)
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    start: StartWeights = StartWeights(),  # noqa: B008 (a Flyte input's default is its value)
    start_sha256: str = "",  # the starting weights' content: what the cache keys on (start is ignored)
    trial: TrialSpec = TrialSpec(),  # noqa: B008 (a search's trial: where it reports, what prunes it)
    trial_key: str = "",  # what the cache keys on of the trial (trial is ignored): TrialSpec.key()
    workers: int = 0,  # how many workers FLYSCALE_NPROC_PER_NODE=auto chose locally (0: the launcher's count)
    tokenizer: FlyteFile | None = None,  # text: the tokenizer the model's ids are of, handed on in its bundle
    tokenizer_sha256: str = "",  # ValidatedData.tokenizer_sha256: what the cache keys on (tokenizer is ignored)
) -> Trained:
    """Train with the configured strategy on every worker; rank 0 returns the weights, and logs
    each epoch to the execution's MLflow run as it ends. Checkpoints as `recovery` says, and
    resumes from the newest one of this training (after a worker restart, a Flyte retry, or
    the same command again after a Ctrl-C)."""
    keyed(tokenizer, tokenizer_sha256, "the tokenizer")
    trained = train_job(
        train,
        val,
        info,
        model_cfg,
        cfg,
        fingerprint,
        started,
        mlflow_cfg,
        recovery,
        augment=augment,
        objective=objective,
        start=start,
        trial=trial,
        preflight=preflight,
    )
    if trained is None:
        return None  # type: ignore[return-value]  # other ranks: no outputs
    kept_cfg, weights = kept(model_cfg, info, trained.path)  # LoRA's adapters merged, say
    bundle = ModelBundle(FlyteFile(weights), file_sha256(weights), info, kept_cfg, objective, tokenizer=tokenizer)
    return Trained(bundle, trained.history)
