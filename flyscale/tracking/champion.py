"""The champion alias, read: which version a candidate is judged against.

- Reading fails closed: only "no such registered model" (or a model without the alias) means
  there is no champion. Any other MLflow error, after MLflow's own bounded retries, fails the run
  with a retryable error: a 503 is never read as "nothing there".
- A candidate is judged against the current champion, unless the champion is this very
  candidate (same weights): a rerun of the run that won is judged against what it beat, so it
  replays its verdict instead of losing to itself.

Moving the alias, by compare-and-set under a lock, is flyscale/tracking/promotion.py.
"""

from __future__ import annotations

from flyscale.config import MlflowConfig
from flyscale.evaluate.gating import ChampionRef
from flyscale.tracking.store import (
    client_settings,
    mlflow_errors,
    tracking_uri,
)

WEIGHTS_TAG = "flyscale.weights_sha256"  # on every version flyscale registers
TEST_DATA_TAG = "flyscale.test_data_sha256"  # on each version: the fingerprint of the test split it was scored on
JUDGED_TAG = "flyscale.judged_against_version"  # on each version: the champion it was judged against ("" = none)


def _missing(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def current_version(client, model_name: str, alias: str):
    """The ModelVersion `alias` points at, or None when the model or the alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(model_name)
    except MlflowException as exc:
        if _missing(exc):
            return None
        raise
    version = model.aliases.get(alias)
    return client.get_model_version(model_name, version) if version else None


def _ref(client, model_name: str, alias: str, version) -> ChampionRef:
    if version is None:
        return ChampionRef(model_name, alias)
    run_id = version.tags.get("flyscale.run_id") or version.run_id
    metrics = client.get_run(run_id).data.metrics
    found = {k.removeprefix("test_"): float(v) for k, v in metrics.items() if k.startswith("test_")}
    return ChampionRef(model_name, alias, str(version.version), run_id, found, version.tags.get(TEST_DATA_TAG, ""))


def baseline(client, model_name: str, alias: str, candidate_sha256: str) -> ChampionRef:
    """The champion a candidate with these weights is judged against (see the module docstring)."""
    from mlflow.exceptions import MlflowException

    champion = current_version(client, model_name, alias)
    if champion is not None and champion.tags.get(WEIGHTS_TAG) == candidate_sha256:
        beaten = champion.tags.get(JUDGED_TAG, "")
        try:
            champion = client.get_model_version(model_name, beaten) if beaten else None
        except MlflowException as exc:
            if not _missing(exc):
                raise
            champion = None  # the version it beat was deleted since: nothing left to compare with
    return _ref(client, model_name, alias, champion)


def read_baseline(cfg: MlflowConfig, candidate_sha256: str) -> ChampionRef:
    """The champion a candidate is judged against, read live from the store (fails closed)."""
    from mlflow import MlflowClient

    with client_settings(cfg), mlflow_errors(f"reading the {cfg.alias!r} of {cfg.model_name!r}"):
        return baseline(MlflowClient(tracking_uri()), cfg.model_name, cfg.alias, candidate_sha256)
