"""Gates: fixed thresholds, and comparison against the champion read from a real MLflow store."""

from __future__ import annotations

import mlflow
import pytest
from mlflow import MlflowClient

from flyscale.config import GateConfig, GatesConfig, MlflowConfig, from_dict
from flyscale.evaluate import gating
from flyscale.evaluate.gating import ChampionRef
from flyscale.tracking.champion import read_baseline
from flyscale_plugins.gates import (
    BeatsChampionOptions,
    MinMetricOptions,
    QuantizationOptions,
    ServedOptions,
    beats_champion,
    min_metric,
    quantization,
    served,
)


def test_min_metric_threshold_is_inclusive_and_says_why():
    ok = min_metric.check({"accuracy": 0.95}, MinMetricOptions(threshold=0.95), None)
    bad = min_metric.check({"accuracy": 0.9499}, MinMetricOptions(threshold=0.95), None)
    assert ok.passed and not bad.passed
    assert "0.9499 < threshold 0.9500" in bad.reason


def test_min_metric_bounds_any_metric_by_its_nature():
    opts = MinMetricOptions(threshold=0.9, thresholds={"loss": 0.3, "latency_p99_ms_b64": 5.0})
    good = {"accuracy": 0.95, "loss": 0.2, "latency_p99_ms_b64": 4.0}
    assert min_metric.check(good, opts, None).passed
    slow = min_metric.check({**good, "latency_p99_ms_b64": 6.0}, opts, None)
    assert not slow.passed and "latency_p99_ms_b64 6.0000 > threshold 5.0000" in slow.reason  # lower is better
    lossy = min_metric.check({**good, "loss": 0.31}, opts, None)
    assert not lossy.passed and "loss 0.3100 > threshold 0.3000" in lossy.reason
    missing = min_metric.check({"accuracy": 0.99, "loss": 0.1}, opts, None)
    assert not missing.passed and "no latency_p99_ms_b64 was recorded" in missing.reason  # never passes on a gap
    with pytest.raises(ValueError, match="no known direction for metric 'auc'"):
        MinMetricOptions(thresholds={"auc": 0.9})


def test_the_quantization_gate_bounds_cost_and_demands_gain():
    metrics = {"int8_accuracy_drop": 0.004, "int8_speedup_b64": 1.8, "int8_size_ratio": 3.9}
    opts = QuantizationOptions(max_accuracy_drop=0.01, min_speedup=1.5, min_size_ratio=3.5)
    assert quantization.check(metrics, opts, None).passed
    slow = quantization.check({**metrics, "int8_speedup_b64": 1.2}, opts, None)
    assert not slow.passed and "speedup b64 +1.2000 < needed 1.5000" in slow.reason
    lossy = quantization.check({**metrics, "int8_accuracy_drop": 0.02}, opts, None)
    assert not lossy.passed and "accuracy drop +0.0200 > allowed 0.0100" in lossy.reason
    assert quantization.check(
        {"int8_accuracy_drop": 0.0}, QuantizationOptions(), None
    ).passed  # only the drop by default


def test_the_served_gate_holds_the_served_model_to_its_latency_and_its_export_to_parity():
    metrics = {
        "onnx_max_abs_diff": 3e-6,
        "served_c16_latency_p99_ms": 12.0,
        "served_c16_error": 0.0,
        "served_c16_throughput": 900.0,
    }
    opts = ServedOptions(max_p99_ms=50, at_concurrency=16, min_throughput=500)
    ok = served.check(metrics, opts, None)
    assert ok.passed and "served p99 at 16 clients (ms) 12 <= 50" in ok.reason
    slow = served.check({**metrics, "served_c16_latency_p99_ms": 75.0}, opts, None)
    assert not slow.passed and "served p99 at 16 clients (ms) 75 > 50" in slow.reason
    lossy = served.check({**metrics, "served_c16_error": 0.01}, opts, None)
    assert not lossy.passed and "requests failed at 16 clients 0.01 > 0" in lossy.reason
    drifted = served.check({**metrics, "onnx_max_abs_diff": 0.2}, opts, None)
    assert not drifted.passed and "max difference from PyTorch 0.2 > 0.0001" in drifted.reason
    untested = served.check({"onnx_max_abs_diff": 0.0}, opts, None)
    assert not untested.passed and "no served_c16_latency_p99_ms was recorded" in untested.reason


@pytest.mark.parametrize(
    "serving,message",
    [
        ({}, "only the load test of the served model records: set serving.loadtest: true"),
        ({"loadtest": True, "levels": [1, 4]}, r"serving.levels \[1, 4\] does not load-test 16 clients"),
    ],
)
def test_a_served_gate_without_the_load_test_it_reads_is_refused_before_the_run(serving, message):
    with pytest.raises(ValueError, match=message):
        from_dict({"serving": serving, "gate": [{"name": "served", "options": {"at_concurrency": 16}}]})
    from_dict({"serving": {"loadtest": True, "levels": [16]}, "gate": [{"name": "served"}]})  # what works


def test_every_gate_is_judged_and_all_must_pass():
    gates = GatesConfig(gates=[GateConfig("min_metric", {"threshold": 0.9}), GateConfig("quantization")])
    metrics = {"accuracy": 0.95, "int8_accuracy_drop": 0.05}
    judgment = gating.judge(gates, metrics, ChampionRef("m", "champion"))
    assert [v.name for v in judgment.verdicts] == ["min_metric", "quantization"]
    assert [v.passed for v in judgment.verdicts] == [True, False] and not judgment.passed
    assert judgment.failed == ["quantization: accuracy drop +0.0500 > allowed 0.0100"]
    assert gating.judge(gates, {**metrics, "int8_accuracy_drop": 0.0}, ChampionRef("m", "champion")).passed


def test_gate_takes_a_list_or_one_mapping_on_every_way_in():
    listed = from_dict({"gate": [{"name": "min_metric"}, {"name": "beats_champion", "options": {"metric": "loss"}}]})
    assert [g.name for g in listed.gate.gates] == ["min_metric", "beats_champion"]
    assert [g.name for g in from_dict({"gate": {"name": "beats_champion"}}).gate.gates] == ["beats_champion"]
    assert [g.name for g in from_dict({}).gate.gates] == ["min_metric", "beats_champion", "quantization"]
    with pytest.raises(ValueError, match="listed twice"):
        from_dict({"gate": [{"name": "min_metric"}, {"name": "min_metric"}]})
    with pytest.raises(ValueError, match=r"gate\.gates\.0\.nmae: unknown field; did you mean .name.\?"):
        from_dict({"gate": [{"nmae": "min_metric"}]})


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def _baseline(sha: str = "candidate") -> dict | None:
    return read_baseline(MlflowConfig(model_name="digits"), sha).for_gate("unknown")  # test data as given


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


def test_beats_champion_has_mlflow_metric_threshold_semantics():
    champion = {"accuracy": 0.90, "loss": 0.40, "version": 3.0, "same_test_data": 1.0}
    absolute = BeatsChampionOptions(min_absolute_change=0.02)
    assert not beats_champion.check({"accuracy": 0.915}, absolute, champion).passed
    assert beats_champion.check({"accuracy": 0.925}, absolute, champion).passed
    relative = BeatsChampionOptions(min_relative_change=0.05)  # 5 % of 0.90 = 0.045
    assert not beats_champion.check({"accuracy": 0.94}, relative, champion).passed
    assert beats_champion.check({"accuracy": 0.95}, relative, champion).passed
    # Lower is better for a loss: a smaller loss beats, by the nature of the metric.
    loss = BeatsChampionOptions(metric="loss", min_absolute_change=0.05)
    assert beats_champion.check({"loss": 0.30}, loss, champion).passed
    assert not beats_champion.check({"loss": 0.38}, loss, champion).passed
    assert not beats_champion.check(
        {"loss": 0.30}, BeatsChampionOptions(metric="loss", greater_is_better=True), champion
    ).passed


def test_a_champion_tested_on_other_data_is_reported_not_silently_compared():
    gates = GatesConfig(gates=[GateConfig("beats_champion")])
    champion = ChampionRef("m", "champion", "3", "run", {"accuracy": 0.9}, test_sha256="a" * 64)
    same = gating.judge(gates, {"accuracy": 0.95}, champion, "a" * 64)
    assert same.passed and same.test_data.startswith("the same test data as champion v3")
    other = gating.judge(gates, {"accuracy": 0.95}, champion, "b" * 64)
    assert other.passed and "OTHER test data than champion v3" in other.test_data
    strict = GatesConfig(gates=[GateConfig("beats_champion", {"require_same_test_data": True})])
    refused = gating.judge(strict, {"accuracy": 0.95}, champion, "b" * 64)
    assert not refused.passed and "tested on other data" in refused.verdicts[0].reason


def test_beats_champion_options_are_validated():
    with pytest.raises(ValueError, match="no known direction for metric 'auc'"):
        BeatsChampionOptions(metric="auc")
    with pytest.raises(ValueError, match="min_absolute_change"):
        BeatsChampionOptions(min_absolute_change=-1)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"min_speedup": -1.0}, "min_speedup must be >= 0"),
        ({"min_size_ratio": -0.5}, "min_size_ratio must be >= 0"),
        ({"max_accuracy_drop": 2.0}, r"max_accuracy_drop must be in \[0, 1\]"),
        ({"max_worse": {"perplexity": -0.1}}, "max_worse.perplexity must be a number >= 0"),
        ({"max_worse": {"auc": 0.1}}, "no known direction for metric 'auc'"),
    ],
)
def test_quantization_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        QuantizationOptions(**options)


def test_quantization_reads_the_cost_of_each_bounded_metric_by_its_direction():
    opts = QuantizationOptions(max_worse={"perplexity": 0.2, "r2": 0.02})
    assert opts.costs() == [("int8_perplexity_increase", 0.2), ("int8_r2_drop", 0.02)]
    assert QuantizationOptions().costs() == [("int8_accuracy_drop", 0.01)]


def test_int8_that_does_not_pay_is_judged_by_what_it_measured():
    from flyscale.evaluate.comparison import Comparison
    from flyscale.evaluate.latency import LatencyReport

    def timed(p50s: list[float]) -> LatencyReport:
        return LatencyReport("m", [1, 64, 256], p50s, p50s)

    # The ResNet: a larger file, and 0.94-1.00x the speed.
    resnet = Comparison("dynamic_int8", size_ratio=0.96, fp32_latency=timed([1.0, 4.0, 27.0]))
    resnet.int8_latency = timed([1.0, 4.2, 28.7])
    resnet.judge("tried static_int8 too")
    assert not resnet.pays and resnet.verdict.startswith("does not pay, not smaller and faster: dynamic_int8: 0.96x")
    assert resnet.verdict.endswith("; tried static_int8 too") and resnet.scalars()["int8_pays"] == 0.0
    # The digits MLP: slower at batch 1, faster where batches are large; smaller. It pays.
    mlp = Comparison("dynamic_int8", size_ratio=3.5, fp32_latency=timed([0.018, 0.100, 0.235]))
    mlp.int8_latency = timed([0.022, 0.059, 0.201])
    assert mlp.judge().pays and mlp.verdict.startswith("pays: dynamic_int8: 3.50x smaller, 1.17x the speed")
    # Within the noise of the timings is not faster, nor a few bytes less smaller (the photo ResNet's
    # 1.00x smaller, 1.00x the speed).
    even = Comparison("dynamic_int8", size_ratio=1.003, fp32_latency=timed([1.0, 4.0, 27.0]))
    even.int8_latency = timed([0.99, 3.98, 26.9])
    assert not even.judge().pays and even.verdict.startswith(
        "does not pay, not smaller and faster: dynamic_int8: 1.00x"
    )
    gate, options = quantization, QuantizationOptions()
    unpaid = gate.check({**resnet.scalars(), "int8_accuracy_drop": 0.5}, options, None)
    assert unpaid.passed and "int8 is not registered" in unpaid.reason  # no twin: its accuracy is not bounded
    assert not gate.check({**mlp.scalars(), "int8_accuracy_drop": 0.5}, options, None).passed
