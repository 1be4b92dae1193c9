"""A scaling study through real `pyflyte run` against a real MLflow server: 3 data fractions,
3 model sizes and 2 worker counts complete; every point is a child of one parent run, with the
epoch curves its training logged; a second identical run is served from the cache and logs
nothing again."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import BIN, REPO

EXPERIMENT = "scaling-e2e"
DIGITS = REPO / "configs/scaling-digits.yaml"
PRESET = {  # the digits preset made small
    "augment": {"copies": 0},
    "model": {"name": "mlp", "options": {"hidden": [64, 32]}},
    "train": {"epochs": 2, "batch_size": 64},
    # The base point on 2 workers: forked workers start in 0.5 s, a single (spawned) one in ~5 s.
    "scaling": {
        "data_fractions": [0.25, 0.5],
        "width_multipliers": [0.25, 0.5],
        "workers": [1, 2],
        "base_workers": 2,
        "experiment": EXPERIMENT,
    },
}
POINTS = {  # 1 + 2 data fractions, 1 + 2 widths, 1 + 1 worker counts around the base point
    "data0.25-width1-depth1-workers2",
    "data0.5-width1-depth1-workers2",
    "data1-width1-depth1-workers2",
    "data1-width0.25-depth1-workers2",
    "data1-width0.5-depth1-workers2",
    "data1-width1-depth1-workers1",
}


def run_study(home, preset, env, *more) -> subprocess.CompletedProcess:
    """`pyflyte run workflows/scaling.py scaling_study --cfg PRESET [--cfg MORE ...]`, as a user types it."""
    full_env = {**os.environ, "HOME": str(home), "FLYTE_SDK_LOGGING_LEVEL": "20", "COLUMNS": "400", **env}
    presets = [a for p in (preset, *more) for a in ("--cfg", str(p))]
    proc = subprocess.run(
        [str(BIN / "pyflyte"), "run", "workflows/scaling.py", "scaling_study", *presets],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _study_runs(client: MlflowClient, name: str = EXPERIMENT):
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("flyscale.scaling") == "study"]
    children = [r for r in runs if r not in parents]
    return parents, children


def _workspace(tmp_path, preset: dict, mlflow_server: str):
    """The preset as a file, a fresh HOME (so a fresh Flyte cache) and the study's environment.
    TMPDIR: flytekit's local sandbox, and so the Deck files, land under tmp_path."""
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(preset))
    home = tmp_path / "home"
    home.mkdir()
    return path, home, {"MLFLOW_TRACKING_URI": mlflow_server, "TMPDIR": str(tmp_path)}


@pytest.mark.timeout(600)
def test_a_study_completes_logs_every_point_under_one_parent_and_reruns_from_the_cache(tmp_path, mlflow_server):
    preset, home, env = _workspace(tmp_path, PRESET, mlflow_server)
    client = MlflowClient(mlflow_server)

    first = run_study(home, DIGITS, env, preset)
    assert "points      6 training runs; trained now: 6, from the cache: 0" in first.stdout, first.stdout[-3000:]
    assert set(re.findall(r"point\s+(data\S+)", first.stdout)) == POINTS
    assert re.search(r"fit\s+error vs training rows: no fit \(3 distinct sizes", first.stdout)  # 3 is too few
    assert re.search(r"workers\s+use (one worker|2 workers): ", first.stdout)

    parents, children = _study_runs(client)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    assert re.search(rf"mlflow\s+parent run {parent} ", first.stdout)
    assert {c.info.run_name for c in children} == POINTS  # every run in the experiment is a point of it
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent}
    assert {c.info.status for c in children} == {"FINISHED"}
    for child in children:
        # The child is the live run its training logged each epoch to, now with the point's numbers.
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_accuracy")] == [0, 1]
        assert child.data.tags["flyscale.scaling.trained"] == "in this execution"
        assert 0 <= child.data.metrics["point_val_error"] <= 1 and child.data.metrics["point_samples_per_s"] > 0
    widths = {c.info.run_name: c.data.metrics["point_parameters"] for c in children}
    assert (
        widths["data1-width0.25-depth1-workers2"]
        < widths["data1-width0.5-depth1-workers2"]
        < widths["data1-width1-depth1-workers2"]
    )
    rows = {c.info.run_name: c.data.metrics["point_train_rows"] for c in children}
    assert (
        rows["data0.25-width1-depth1-workers2"]
        < rows["data0.5-width1-depth1-workers2"]
        < rows["data1-width1-depth1-workers2"]
    )
    plots = {a.path for a in client.list_artifacts(parent, "plots")}
    names = ("scaling", "error_vs_data", "error_vs_parameters", "workers", "gap")
    assert plots == {f"plots/{name}.png" for name in names}
    recommendations = open(client.download_artifacts(parent, "recommendations.txt", str(tmp_path))).read()
    assert "error vs training rows: no fit" in recommendations and "workers: use" in recommendations
    decks = [p.read_text() for p in tmp_path.glob("flyte-*/sandbox/local_flytekit/*/deck.html")]
    assert any("<h3>Scaling study</h3>" in d and 'src="data:image/png;base64,' in d for d in decks)

    second = run_study(home, DIGITS, env, preset)
    assert "points      6 training runs; trained now: 0, from the cache: 6" in second.stdout, second.stdout[-3000:]
    log = second.stdout + second.stderr
    assert "Cache miss" not in log and log.count("Cache hit") >= 6 + 3, log[
        -4000:
    ]  # each point (trained and measured in one task), the subsets
    assert re.search(rf"mlflow\s+parent run {parent} ", second.stdout)  # the cached report's: nothing logged twice
    assert [len(runs) for runs in _study_runs(client)] == [1, 6]


TEXT_EXPERIMENT = "scaling-text-e2e"
TEXT_SMALL = {  # configs/scaling-text-gpt.yaml made small: 4 nested fractions and 2 widths, one epoch
    "model": {"options": {"layers": 1, "heads": 2, "width": 32}},
    "train": {"epochs": 1, "batch_size": 64},
    "scaling": {"width_multipliers": [0.5, 1.0], "experiment": TEXT_EXPERIMENT},
}


@pytest.mark.timeout(600)
def test_a_language_model_study_fits_loss_against_training_tokens_and_reruns_from_the_cache(tmp_path, mlflow_server):
    """The text preset's study: the pipeline's own text branch prepares the sequences, every point
    is measured by its validation loss (nats a token) with a standard error, and the data axis is
    the tokens its nested subset holds."""
    small, home, env = _workspace(tmp_path, TEXT_SMALL, mlflow_server)
    client = MlflowClient(mlflow_server)

    first = run_study(home, REPO / "configs/scaling-text-gpt.yaml", env, small)
    out = first.stdout
    assert "points      5 training runs; trained now: 5, from the cache: 0" in out, out[-3000:]
    assert "tokenize_text" in first.stdout + first.stderr  # the pipeline's text branch ran
    # Each point: its rows, the tokens they hold (seq_len 64: 63 targets a sequence), val loss +- its noise.
    found = re.findall(
        r"point\s+(data\S+)\s+([\d,]+) rows\s+([\d,]+) tokens .*? val loss ([\d.]+) \(\+-([\d.]+)\)", out
    )
    assert len(found) == 5, out[-3000:]
    tokens = {}
    for key, rows, count, loss, noise in found:
        assert int(count.replace(",", "")) == 63 * int(rows.replace(",", ""))
        assert 0.5 < float(loss) < 5.6 and 0 < float(noise) < 0.2  # under ln(257), a uniform guess
        tokens[key] = int(count.replace(",", ""))
    fractions = [f"data{f}-width1-depth1-workers1" for f in ("0.125", "0.25", "0.5", "1")]
    assert [tokens[k] for k in fractions] == sorted(tokens[k] for k in fractions)
    assert re.search(r"fit\s+loss vs training tokens: ", out) and re.search(r"fit\s+loss vs parameters: no fit", out)
    assert re.search(r"knee\s+data: [\d,]+ training tokens \(fraction", out)

    parents, children = _study_runs(client, TEXT_EXPERIMENT)
    parent = parents[0].info.run_id
    assert len(parents) == 1 and {c.info.run_name for c in children} == set(tokens)
    for child in children:
        metrics = child.data.metrics
        assert metrics["point_train_tokens"] == tokens[child.info.run_name] == 63 * metrics["point_train_rows"]
        assert metrics["point_val_loss"] > 0 and metrics["point_val_loss_stderr"] > 0
    plots = {a.path for a in client.list_artifacts(parent, "plots")}
    assert {"plots/loss_vs_data.png", "plots/loss_vs_parameters.png"} <= plots

    second = run_study(home, REPO / "configs/scaling-text-gpt.yaml", env, small)
    log = second.stdout + second.stderr
    assert "Cache miss" not in log, log[log.index("Cache miss") - 3000 : log.index("Cache miss") + 500]
    assert "points      5 training runs; trained now: 0, from the cache: 5" in second.stdout, second.stdout[-3000:]
