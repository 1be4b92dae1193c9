"""Batch prediction stages: which version scores which pieces of the dataset, each piece scored
as a Flyte map task (a pod each on a cluster), and the pieces gathered into one output."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from flytekit import map_task, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.config import DataConfig
from flyscale.flyte.dataclass_types import register
from flyscale.flyte.outputs import output_dir
from flyscale.serving import batch
from tasks.common import SMALL, TASK, TRACKED


@dataclass
class PredictionPlan:
    model_uri: str  # models:/NAME/VERSION: the alias is resolved once, so every piece uses one version
    parts: list[str]


@dataclass
class ScoredPart:
    file: FlyteFile
    rows: int


@dataclass
class Predictions:
    """The dataset's predictions: Parquet, a file per piece, one row per input row."""

    dir: FlyteDirectory
    rows: int
    files: int
    model_uri: str


register(PredictionPlan, ScoredPart, Predictions)


@task(cache=False, **TRACKED, requests=SMALL)
def plan_predictions(data: DataConfig, model: str, version: str = "", alias: str = "champion") -> PredictionPlan:
    """The version to score with (`version`, or the one `alias` points at now) and the pieces to score."""
    from mlflow import MlflowClient

    from flyscale.tracking.store import tracking_uri

    resolved = version or MlflowClient(tracking_uri()).get_model_version_by_alias(model, alias).version
    return PredictionPlan(f"models:/{model}/{resolved}", batch.parts(data))


@task(cache=False, **TRACKED, requests=SMALL)
def score_part(part: str, data: DataConfig, model_uri: str) -> ScoredPart:
    """One piece of the dataset scored: Parquet with the input key, the version and the prediction."""
    # A piece gather_predictions copies into the run's folder of predictions: temporary.
    out = Path(tempfile.mkdtemp(prefix="flyscale-predict-")) / "predictions.parquet"
    scored = batch.score_part(data, part, model_uri, out)
    return ScoredPart(FlyteFile(scored.path), scored.rows)


score_parts = map_task(score_part, bound_inputs={"data", "model_uri"})


@task(cache=False, **TASK, requests=SMALL)
def gather_predictions(parts: list[ScoredPart], plan: PredictionPlan) -> Predictions:
    """The pieces' files in one folder, named by their order in the dataset."""
    import shutil

    out = output_dir("flyscale-predictions-")
    for i, part in enumerate(parts):
        shutil.copyfile(part.file.download(), out / f"part-{i:05d}.parquet")
    return Predictions(FlyteDirectory(str(out)), sum(p.rows for p in parts), len(parts), plan.model_uri)
