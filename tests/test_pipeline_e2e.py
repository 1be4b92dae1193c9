"""The whole pipeline under real `pyflyte run`, 2 DDP worker processes, a real MLflow server."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import run_pipeline

# Cached: load, validate, split, augment, preflight, train, evaluate, quantize, register. Never
# cached: fingerprint_data, gate_model and summarize, which read the data and the champion as they are.
N_CACHED = 9


def _run_id(stdout: str) -> str:
    match = re.search(r"mlflow\s+run (\w+)", stdout)
    assert match, f"no run id in the summary:\n{stdout[-2000:]}"
    return match.group(1)


def _ok(proc) -> str:
    assert proc.returncode == 0, f"pyflyte run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def quick_cfg(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "e2e.yaml"
    path.write_text(yaml.safe_dump({
        "augment": {"copies": 1},
        "train": {"epochs": 8, "batch_size": 64},
        "mlflow": {"experiment": "e2e", "model_name": "e2e-digits"},
    }))
    return path


@pytest.mark.timeout(900)
def test_pipeline_registers_model_and_second_run_hits_cache(tmp_path, mlflow_server, quick_cfg):
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    first = run_pipeline(tmp_path, "--cfg", str(quick_cfg), env=env)
    out = _ok(first)
    assert "flyscale run summary" in out
    run_id = _run_id(out)

    # Read everything back from the tracking server, not from our own output.
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["test_accuracy"] - metrics["int8_test_accuracy"] <= 0.01
    assert metrics["int8_test_size_bytes"] < metrics["test_size_bytes"]
    assert params["train.epochs"] == "8" and params["model.name"] == "mlp"
    assert tags["flyscale.world_size"] == "2" and tags["flyscale.strategy"] == "ddp"
    history = client.get_metric_history(run_id, "val_accuracy")
    assert [m.step for m in history] == list(range(8))
    artifacts = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert artifacts == {"plots/confusion_fp32.png", "plots/confusion_int8.png", "plots/reliability_fp32.png",
                         "plots/learning_curves.png", "plots/latency.png"}
    assert metrics["test_latency_p99_ms_b64"] >= metrics["test_latency_p50_ms_b64"] > 0
    assert metrics["test_int8_speedup_b64"] > 0 and 0 <= metrics["test_ece"] <= 1
    # The latency table as MLflow's UI shows it (log_table's JSON: columns and rows).
    table = json.loads(open(client.download_artifacts(run_id, "latency.json", str(tmp_path))).read())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert sorted({r["model"] for r in rows}) == ["fp32", "int8"]
    assert sorted({r["batch_size"] for r in rows}) == [1, 8, 64, 256]
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)

    champion = client.get_model_version_by_alias("e2e-digits", "champion")
    assert champion.tags["flyscale.run_id"] == run_id
    assert client.get_model_version_by_alias("e2e-digits-int8", "champion").tags["flyscale.run_id"] == run_id
    # What the decisions rested on is on the run: the data, the cache, the champion compared with.
    assert len(tags["flyscale.data_fingerprint"]) == 64 and "digits" in tags["flyscale.data_fingerprint_method"]
    assert tags["flyscale.cache.train_model"] == "miss" and tags["flyscale.cache.gate_model"] == "always runs"
    assert tags["flyscale.judged_against"] == "no champion"
    assert "cache       ran load_data, validate_data" in out and "from the cache: nothing" in out

    # Identical second run: every cached task is served from the cache, nothing is registered twice.
    second = run_pipeline(tmp_path, "--cfg", str(quick_cfg), env=env)
    out2 = _ok(second)
    log = second.stdout + second.stderr
    assert log.count("Cache hit") == N_CACHED, log[-4000:]
    assert "Cache miss" not in log
    assert "cache       ran nothing; from the cache: load_data" in out2
    assert _run_id(out2) == run_id
    assert len(client.search_model_versions("name='e2e-digits'")) == 1


@pytest.mark.timeout(900)
def test_failed_gate_registers_nothing_as_champion(tmp_path, mlflow_server, quick_cfg):
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    cfg = yaml.safe_load(quick_cfg.read_text())
    cfg["mlflow"]["model_name"] = "e2e-gate"
    cfg["gate"] = {"name": "min_metric", "options": {"metric": "accuracy", "threshold": 1.0}}
    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(cfg))

    out = _ok(run_pipeline(tmp_path, "--cfg", str(path), env=env))
    assert "min_metric: FAILED" in out and "registered  no version" in out and "not registered: a gate failed" in out
    assert "ran " in out and "record_candidate" in out and "register_model" not in out  # the other branch ran
    client = MlflowClient(mlflow_server)
    run = client.get_run(_run_id(out))
    assert run.data.tags["flyscale.gates"] == "failed"
    assert run.data.tags["gate.min_metric"].startswith("failed: test accuracy")
    # The run and both its models are logged for inspection, but no version is registered.
    logged = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run.info.run_id}'")
    assert sorted(m.name for m in logged) == ["model", "model_int8"]
    assert client.search_model_versions("name='e2e-gate'") == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "preset, message",
    [
        ("train: {epochs: -1}", "train.epochs must be > 0"),
        # Unknown keys are refused with the nearest name, in YAML and in JSON, at every depth.
        ("train: {epoch: 3}", "train.epoch: unknown field; did you mean 'epochs'?"),
        ("model: {nmae: cnn}", "model.nmae: unknown field; did you mean 'name'?"),
        ("trian: {epochs: 3}", "unknown config section 'trian'; did you mean 'train'?"),
        ('{"model": {"name": "cnn", "options": {"chanels": [8]}}}',
         "model.options.chanels: unknown option; did you mean 'channels'?"),
    ],
)
def test_bad_config_fails_before_any_task_naming_the_key(tmp_path, preset, message):
    path = tmp_path / ("bad.json" if preset.startswith("{") else "bad.yaml")
    path.write_text(preset)
    proc = run_pipeline(tmp_path, "--cfg", str(path))
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert message in log, log[-3000:]
    assert "fingerprint_data" not in log and "Checking cache for task" not in log  # no task started


@pytest.mark.timeout(120)
def test_inline_json_preset_is_strict_too(tmp_path):
    proc = run_pipeline(tmp_path, "--cfg", '{"train": {"epoch": 3}}')
    assert proc.returncode != 0 and "train.epoch: unknown field; did you mean 'epochs'?" in proc.stdout + proc.stderr


@pytest.mark.timeout(900)
def test_pipeline_strategy_trains_digits_through_pyflyte(tmp_path):
    """`strategy: pipeline` (2 stages, 1F1B) reaches the same bar as DDP under real pyflyte run.

    The same run switches the preflight check on and looks for the learning-curves Deck, so
    neither costs a pipeline run of its own.
    """
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump({
        "augment": {"copies": 0},
        "train": {"strategy": "pipeline", "epochs": 20, "batch_size": 64, "options": {"schedule": "1f1b", "microbatches": 4}},
        "preflight": {"enabled": True, "steps": 5},
        "mlflow": {"experiment": "e2e-pp", "model_name": "e2e-pp"},
    }))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # TMPDIR: flytekit's local sandbox, and so the Deck files, land under tmp_path.
    proc = run_pipeline(tmp_path, "--cfg", str(path), env={"MLFLOW_TRACKING_URI": uri, "TMPDIR": str(tmp_path)})
    out = _ok(proc)
    run = MlflowClient(uri).get_run(_run_id(out))
    assert run.data.tags["flyscale.strategy"] == "pipeline"
    assert run.data.tags["flyscale.world_size"] == "2"
    assert run.data.params["train.options.schedule"] == "1f1b"
    assert run.data.metrics["test_accuracy"] >= 0.95

    # The preflight ran on the 2 workers and rank 0 logged its per-step comparison.
    log = proc.stdout + proc.stderr
    match = re.search(r"preflight passed: 5 steps of pipeline, world size 1 vs 2, max relative difference (\S+)", log)
    assert match, log[-4000:]
    assert float(match.group(1)) < 1e-5
    assert run.data.metrics["preflight_max_rel_diff"] == pytest.approx(float(match.group(1)), rel=1e-2, abs=1e-12)
    assert "preflight   PASSED: 5 steps at world size 1 vs 2" in out  # and in the summary
    assert re.search(r"^\s+5\s+\d+\.\d+\s+\d+\.\d+", log, re.MULTILINE)  # the table's last step
    # Rank 0's Deck reached the parent process and was written with the plot and the last epoch.
    decks = [p.read_text() for p in tmp_path.glob("flyte-*/sandbox/local_flytekit/*/deck.html")]
    curves = [d for d in decks if "<h3>Learning curves</h3>" in d]
    assert curves, f"{len(decks)} deck files, none with learning curves"
    assert any("<h3>Evaluation on the test split</h3>" in d for d in decks), "no Evaluation deck"
    assert 'src="data:image/png;base64,' in curves[0] and "20 epochs; last epoch" in curves[0]
