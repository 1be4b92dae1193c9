"""What every flyscale task shares: the pinned image, the resolver that checks it, the
environment of its pod, the resources of a small stage, its Decks, and the Flyte types."""

from __future__ import annotations

from flytekit.deck import DeckField

from flyscale import config, settings
from flyscale.cluster import resources
from flyscale.cluster.image import pinned_image_resolver, registration_image
from flyscale.data.example_prep import ShardPart
from flyscale.data.reference import FeatureProfile, PinnedSchema, Profile, Reference
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.gating import ChampionRef, Judgment
from flyscale.evaluate.latency import LatencyReport
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.flyte import heap
from flyscale.flyte.dataclass_types import register
from flyscale.flyte.provenance import CacheReport, TaskRun
from flyscale.plugin.records import DatasetInfo, FieldSpec, GateVerdict
from flyscale.render.data_summary import DataSummary
from flyscale.render.summary import RunSummary
from flyscale.search.study import TrialSpec
from flyscale.tracking import store as tracking_store
from flyscale.tracking.log_and_register import Registration
from flyscale.train.distributed import DistContext, configure_logging
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import EpochMetrics, TrainHistory
from tasks.records import (
    EvaluatedModel,
    ExportedModel,
    ModelBundle,
    ModelCheck,
    QuantizedModel,
    ServedLevel,
    ServedModel,
    StartWeights,
    ValidatedData,
)

# The image the workflow is registered with (None for a local run): every task's container image,
# so that it is part of their cache versions, and named in their pods for the lineage tags.
IMAGE = registration_image()


def task_options(**environment: str) -> dict:
    """What every task is declared with: the registration's image, the resolver that checks it is
    pinned, and its pod's environment (the image's name, and `environment`)."""
    env = {**({settings.IMAGE.name: IMAGE} if IMAGE else {}), **environment}
    return {"container_image": IMAGE, "task_resolver": pinned_image_resolver, "environment": env or None}


def tracked(options: dict) -> dict:
    """`options` of a task that talks to MLflow: it, and only it, is given the pipeline's MLflow
    user as a Flyte secret (flyscale/tracking/store.py)."""
    return {**options, "secret_requests": tracking_store.secret_requests()}


TASK = task_options()
TRACKED = tracked(TASK)  # a task that talks to MLflow

SMALL = resources.SMALL  # every task but training (configs/cluster/resources.yaml)

# flytekit's default Decks of a task that publishes ours, less "Dependencies": a pip list of the
# image, which the lock pins already, and which costs about 1 s of every such task (3 a run).
DECKS = (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)

# Task processes log like rank 0: flyscale's loggers (and the plugins') at INFO. Their levels are
# set explicitly because importing mlflow.pytorch runs logging.basicConfig(level=ERROR), which
# would otherwise silence every warning a run gives after registration has started.
configure_logging(DistContext())
# ...and end without a last walk of their heap by the cycle collector (seconds of a local run).
heap.end_without_collecting()

# Every flyscale dataclass that crosses a task boundary, each described to Flyte once (its JSON
# schema is built once per process, and kept on disk: flyscale/flyte/dataclass_types.py).
register(
    config.PipelineConfig,
    config.DataConfig,
    config.AugmentConfig,
    config.TokenizeConfig,
    config.ModelConfig,
    config.TrainConfig,
    config.PreflightConfig,
    config.RecoveryConfig,
    config.GateConfig,
    config.GatesConfig,
    config.QuantizeConfig,
    config.MlflowConfig,
    config.ObjectiveConfig,
    config.ExportConfig,
    config.ServingConfig,
    DatasetInfo,
    FieldSpec,
    ShardPart,
    TokenStats,
    GateVerdict,
    DataFingerprint,
    ValidationReport,
    Reference,
    PinnedSchema,
    Profile,
    FeatureProfile,
    EvalMetrics,
    Judgment,
    ChampionRef,
    PreflightReport,
    TaskRun,
    CacheReport,
    RunSummary,
    Registration,
    TrainHistory,
    EpochMetrics,
    Shards,
    Comparison,
    LatencyReport,
    ValidatedData,
    ModelBundle,
    EvaluatedModel,
    QuantizedModel,
    ModelCheck,
    StartWeights,
    ExportedModel,
    ServedModel,
    ServedLevel,
    DataSummary,
    TrialSpec,
)
