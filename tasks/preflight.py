"""Checks before training: the model against its strategy before any data work (`check_model`),
and, once the data is ready, a few steps at world size N against one process on the training
workers (`preflight_check`)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import NamedTuple

from flytekit import task
from flytekit.core.task import TaskPlugins
from flytekit.types.file import FlyteFile

from flyscale.cluster.launcher_settings import (
    launcher_environment,
    launcher_facts,
    planned_world_size,
    training_resources,
    workers_auto,
)
from flyscale.cluster.launchers import LocalSafeElastic, LocalSafeElasticTask, local_execution, training_launcher
from flyscale.config import (
    DataConfig,
    MlflowConfig,
    ModelConfig,
    ObjectiveConfig,
    PreflightConfig,
    TokenizeConfig,
    TrainConfig,
)
from flyscale.config.publishing import default_model_name
from flyscale.data import source
from flyscale.data.fields import real_target
from flyscale.data.shards import Shards
from flyscale.data.tokenize import check_tokenizer, planned_info
from flyscale.flyte.caching import code_cache
from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped
from flyscale.model import build_model, parameter_counts
from flyscale.plugin.records import DatasetInfo
from flyscale.tracking import kind, start
from flyscale.tracking.store import tracking_uri
from flyscale.train import distributed, preflight
from flyscale.train import objective as objectives
from flyscale.train.batches import train_data_from
from flyscale.train.preflight import PreflightReport
from flyscale.train.strategies import any_worker_count, strategy, wants_meta_model
from flyscale.train.strategies import check_model as check_against_strategy
from tasks.common import SMALL, task_options, tracked
from tasks.records import ModelCheck, StartWeights


# Never cached: it is cheap, and it reads what the dataset declares as it is now. The pod sees the
# launcher as registered (the world size the model is checked at).
@task(cache=False, **tracked(task_options(**launcher_environment())), requests=SMALL)
def check_model(
    data_cfg: DataConfig,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    tokenize: TokenizeConfig = TokenizeConfig(),  # noqa: B008 (a Flyte input's default is its value)
    mlflow_cfg: MlflowConfig | None = None,
) -> ModelCheck:
    """Before any data work: build the model on the meta device (shapes, no weights) from what
    the dataset declares, and refuse one the training cannot train at the launcher's world size
    (a plain nn.Module or BatchNorm under `pipeline`, ...), naming the layer and the way out;
    refuse data without a label for an objective that needs one; and (`mlflow_cfg`, where the
    run registers) a model of another kind than the one registered under its name."""
    # Documents reach the model as the token sequences the tokenize step will make of them.
    declared = source.info(data_cfg)
    check_tokenizer(declared, tokenize, model_cfg)
    info = planned_info(declared, tokenize)
    if not info.label_column and objective.plugin.attribute("labelled"):
        fields = ", ".join(str(f) for f in info.fields)
        raise ValueError(
            f"dataset {data_cfg.dataset!r} has no label ({fields}), and objective {objective.name!r} needs one. "
            "For text, set `objective: {name: language_modeling}`; to look at the data without training, "
            "`pyflyte run workflows/data.py prepare_data --cfg ...`"
        )
    if objective.plugin.attribute("real_valued") and real_target(info) is None:
        label = next((f for f in info.fields if f.name == info.label_column), None)
        raise ValueError(
            f"objective {objective.name!r} needs a real-valued target, a float label field (such as "
            f"target: float32); dataset {data_cfg.dataset!r} has "
            + (
                f"{label}"
                if label is not None
                else f"the label column {info.label_column!r} of a table, read as class ids"
            )
            + ". Declare the target as a float field of typed examples (docs/regression.md)"
        )
    model = build_model(model_cfg, info, meta=True)
    # Locally the workers a config fixes (a hybrid mesh) are started; a cluster has those registered.
    world_size = planned_world_size(cfg, local=local_execution())
    try:
        check_against_strategy(model, cfg, world_size)
    except ValueError as exc:
        raise ValueError(
            f"model {model_cfg.name!r} cannot be trained with train.strategy {cfg.strategy!r} on {world_size} "
            f"worker(s): {exc}. Nothing was read or trained yet"
        ) from None
    if mlflow_cfg is not None:  # before any data work: the name's kind, read from the registry now
        natural = str(data_cfg.plugin.attribute("objective"))
        default = default_model_name(data_cfg.dataset, objective.name, natural)
        candidate = kind.ModelKind.of(info, objective.name)
        kind.check(mlflow_cfg, candidate, default if default != mlflow_cfg.model_name else "")

    # What training starts from (model.init_from, or the checkpoint a pretrained model names),
    # fetched now (an alias may have moved since the last run) and held to this model. In a
    # temporary folder: this task runs in every execution, and what it hands on is keyed on the
    # file's sha256, so no cache entry names the file.
    def into() -> Path:
        return Path(tempfile.mkdtemp(prefix="flyscale-start-"))

    fetched = start.starting_weights(model_cfg, model, info, into, tracking_uri)
    return ModelCheck(
        model=model_cfg.name,
        strategy=cfg.strategy,
        world_size=world_size,
        parameters=parameter_counts(model)[0],
        layers=[type(m).__name__ for m in model.children()],
        start=StartWeights(FlyteFile(fetched.weights_path), fetched.sha256, fetched.source)
        if fetched
        else StartWeights(),
    )


class Checked(NamedTuple):
    report: PreflightReport
    run: TaskRun = UNSTAMPED  # filled in by @stamped


@dataclasses.dataclass
class PreflightLauncher(LocalSafeElastic):
    """The training launcher, for a task that starts no workers when the check is switched off."""


def choosing_workers(cfg: TrainConfig) -> bool:
    """Whether the preflight times one process against the worker group for `auto` to choose:
    the processes per node are `auto`, and the training's strategy trains the same model on any
    count. (In a pod the training keeps its registered count, whatever the report says.)"""
    return workers_auto() and any_worker_count(cfg)


class PreflightElasticTask(LocalSafeElasticTask):
    def execute(self, **kwargs):
        # The workflow is static, so this task always runs; with nothing to check or choose, it
        # costs no worker start-up.
        choose = local_execution() and choosing_workers(kwargs["cfg"])
        if not kwargs["preflight_cfg"].enabled and not choose:
            return Checked(PreflightReport.skipped(), TaskRun.start("preflight_check"))
        return super().execute(**kwargs)


TaskPlugins.register_pythontask_plugin(PreflightLauncher, PreflightElasticTask)


def _launcher():
    """The training launcher (the same worker group is what is checked), skippable when it is elastic."""
    base = training_launcher()
    if not isinstance(base, LocalSafeElastic):
        return base  # a classic PyTorchJob: every pod runs the body below, which returns at once when off
    return PreflightLauncher(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


@task(
    task_config=_launcher(),
    cache=code_cache("models", "strategies", "objectives", facts={"launcher": launcher_facts}),
    **task_options(**launcher_environment()),  # the pod builds the launcher that was registered
    **training_resources(),  # per worker process, times the processes per node
)
@stamped
def preflight_check(
    train: Shards,
    val: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    preflight_cfg: PreflightConfig,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
) -> Checked:
    """Fail fast, with the numbers, if N workers do not compute what one process computes; with
    FLYSCALE_NPROC_PER_NODE=auto, say whether one process or the N workers train faster."""
    with distributed.process_group() as ctx:
        train_fn, options = strategy(cfg)
        report = preflight.run_preflight(
            lambda: build_model(model_cfg, info, meta=wants_meta_model(cfg)),
            train_data_from(train, val, info, objective=objectives.of(objective)),
            cfg,
            preflight_cfg,
            ctx,
            train_fn,
            options,
            choose=choosing_workers(cfg),
        )
        # The report is rank 0's (the other ranks get None).
        return distributed.rank_zero_outputs(ctx, Checked(report) if report is not None else None)
