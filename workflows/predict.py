"""Batch prediction with a registered version. Wiring only.

    pyflyte run workflows/predict.py batch_predict --model flyscale-digits \
        --data '{"dataset": "parquet", "options": {"path": "s3://bucket/to-score/"}}'

The alias (default `champion`) is resolved once; every piece of the dataset (each file) is
scored by that version in a map task of its own, so on a cluster the work fans out across pods.
"""

from flytekit import workflow

from flyscale.config import DataConfig
from tasks.predict import Predictions, gather_predictions, plan_predictions, score_parts


@workflow
def batch_predict(model: str, data: DataConfig, version: str = "", alias: str = "champion") -> Predictions:
    """plan (version, pieces) -> score each piece (map task) -> gather."""
    plan = plan_predictions(data=data, model=model, version=version, alias=alias)
    scored = score_parts(part=plan.parts, data=data, model_uri=plan.model_uri)
    return gather_predictions(parts=scored, plan=plan)
