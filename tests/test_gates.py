"""Gates: fixed thresholds, and comparison against the champion read from a real MLflow store."""

from __future__ import annotations

import mlflow
import pytest
from mlflow import MlflowClient

from flyscale import tracking
from flyscale.config import MlflowConfig
from flyscale_plugins.gates import BeatsChampionOptions, MinMetricOptions, beats_champion, min_metric


def test_min_metric_threshold_is_inclusive_and_says_why():
    ok = min_metric.check({"accuracy": 0.95}, MinMetricOptions(threshold=0.95), None)
    bad = min_metric.check({"accuracy": 0.9499}, MinMetricOptions(threshold=0.95), None)
    assert ok.passed and not bad.passed
    assert "0.9499 < threshold 0.9500" in bad.reason


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def _baseline(sha: str = "candidate") -> dict | None:
    return tracking.read_baseline(MlflowConfig(model_name="digits"), sha).for_gate()


def _champion(client: MlflowClient, accuracy: float) -> str:
    """Register a version whose run logged `test_accuracy`, and point `champion` at it."""
    mlflow.set_experiment("gates")
    with mlflow.start_run() as run:
        mlflow.log_metrics({"test_accuracy": accuracy, "test_macro_f1": accuracy - 0.01})
    try:
        client.create_registered_model("digits")
    except mlflow.exceptions.MlflowException:
        pass
    version = client.create_model_version("digits", f"runs:/{run.info.run_id}/model", run.info.run_id)
    client.set_registered_model_alias("digits", "champion", version.version)
    return version.version


def test_champion_metrics_read_back_from_the_store(store):
    assert _baseline() is None  # no model yet
    version = _champion(store, 0.96)
    found = _baseline()
    assert found["accuracy"] == pytest.approx(0.96)
    assert found["macro_f1"] == pytest.approx(0.95)
    assert found["version"] == float(version)


def test_beats_champion_against_the_live_champion(store):
    opts = BeatsChampionOptions(metric="accuracy")
    first = beats_champion.check({"accuracy": 0.9}, opts, _baseline())
    assert first.passed and "no champion yet" in first.reason
    _champion(store, 0.96)
    champion = _baseline()
    assert beats_champion.check({"accuracy": 0.97}, opts, champion).passed
    worse = beats_champion.check({"accuracy": 0.96}, opts, champion)
    assert not worse.passed and "champion v1 0.9600" in worse.reason  # a tie does not beat
    strict = beats_champion.check({"accuracy": 0.97}, BeatsChampionOptions(min_improvement=0.02), champion)
    assert not strict.passed


def test_beats_champion_options_are_validated():
    with pytest.raises(ValueError, match="metric must be one of"):
        BeatsChampionOptions(metric="auc")
    with pytest.raises(ValueError, match="min_improvement"):
        BeatsChampionOptions(min_improvement=-1)
