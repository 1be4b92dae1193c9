"""Experiments through real `pyflyte run` against a real MLflow server: a run with early stopping
on a setup that overfits stops before its last epoch and registers the best epoch's weights; a
fine-tune of that champion on new data starts from its weights (its first epoch shows it),
records the lineage, and is served from the cache when run again; weights of another
architecture are refused before any data is read, naming the difference."""

from __future__ import annotations

import json
import re

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, run_pipeline

MODEL = "experiments-e2e"
# 40% of digits to train on and a wide MLP: the validation loss bottoms out, then rises.
BASE = {
    "data": {"val_fraction": 0.3, "test_fraction": 0.3},
    "augment": {"copies": 0},
    "model": {"options": {"hidden": [256], "dropout": 0.0}},
    "train": {"epochs": 40, "batch_size": 16, "lr": 0.003},
    "preflight": {"enabled": False},
    "mlflow": {"model_name": MODEL},
}


def _run(home, server: str, *changes: dict):
    args = [a for c in (BASE, *changes) for a in ("--cfg", json.dumps(c))]
    proc = run_pipeline(home, *args, env={"MLFLOW_TRACKING_URI": server})
    return proc


def _run_id(out: str) -> str:
    match = re.search(r"mlflow\s+run (\w+)", out)
    assert match, out[-3000:]
    return match.group(1)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, mlflow_server):
    proc = _run(tmp_path_factory.mktemp("home"), mlflow_server, {"train": {"early_stopping": {"patience": 3}}})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(600)
def test_early_stopping_stops_before_the_last_epoch_and_registers_the_best_epoch(stopped, mlflow_server):
    client = MlflowClient(mlflow_server)
    run_id = _run_id(stopped)
    history = client.get_metric_history(run_id, "val_loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    best = losses.index(min(losses))
    assert len(losses) == best + 1 + 3 < 40  # stopped three epochs after the best
    run = client.get_run(run_id)
    assert run.data.metrics["kept_epoch"] == best + 1
    tag = run.data.tags["flyscale.early_stopping"]
    assert tag.startswith(f"stopped after epoch {len(losses)} of 40") and f"kept epoch {best + 1}'s weights" in tag
    assert f"  epochs      stopped after epoch {len(losses)} of 40" in stopped
    version = client.get_model_version_by_alias(MODEL, "champion")
    assert version.run_id == run_id


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, mlflow_server, stopped):
    home = tmp_path_factory.mktemp("home")
    parent = MlflowClient(mlflow_server).get_model_version_by_alias(MODEL, "champion").version
    # New data (another split of the rows), two epochs, from the champion's weights, by its version
    # number (the alias may move to the fine-tune itself, and the rerun is to start from the same).
    # Judged by accuracy alone: against the champion's test split, which overlaps the new training rows,
    # beats_champion would say nothing.
    tune = {
        "data": {"seed": 7},
        "train": {"epochs": 2},
        "model": {"init_from": f"models:/{MODEL}/{parent}"},
        "gate": [{"name": "min_metric"}],
    }
    first = _run(home, mlflow_server, tune)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = _run(home, mlflow_server, tune)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return first.stdout, again.stdout


@pytest.mark.timeout(900)
def test_a_fine_tune_starts_from_the_champion_records_the_lineage_and_caches(stopped, fine_tuned, mlflow_server):
    client = MlflowClient(mlflow_server)
    (parent,) = client.search_model_versions(f"name='{MODEL}' and run_id='{_run_id(stopped)}'")
    out, again = fine_tuned
    tuned_run = _run_id(out)

    def first_loss(run_id: str) -> float:
        return min(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step).value

    # From fresh weights the first epoch's loss is about 1.5; from the champion's, far less.
    assert first_loss(tuned_run) < 0.3 * first_loss(_run_id(stopped))
    started = client.get_run(tuned_run).data.tags["flyscale.init_from"]
    assert started.startswith(f"models:/{MODEL}/{parent.version}: version {parent.version} of '{MODEL}', from run")
    assert "weights sha256" in started and f"  started     from models:/{MODEL}/{parent.version}" in out
    (tuned,) = client.search_model_versions(f"name='{MODEL}' and run_id='{tuned_run}'")
    assert tuned.tags["flyscale.init_from"] == started
    # The same command again: the same starting weights, so training comes from the cache.
    ran, cached = _cache_line(again)
    assert "train_model" in cached and "train_model" not in ran


def _cache_line(stdout: str) -> tuple[set[str], set[str]]:
    match = re.search(r"cache\s+ran (.*); from the cache: (.*)", stdout)
    assert match, stdout[-3000:]
    parse = lambda text: set() if text.strip() == "nothing" else {t.strip() for t in text.split(",")}  # noqa: E731
    return parse(match.group(1)), parse(match.group(2))


@pytest.mark.timeout(300)
def test_weights_of_another_architecture_are_refused_before_any_data_work(tmp_path, mlflow_server, stopped):
    other = {"model": {"options": {"hidden": [32]}, "init_from": f"models:/{MODEL}@champion"}}
    proc = _run(tmp_path, mlflow_server, other)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "is another architecture than this run builds: 0.bias is float32 [256] in the starting weights" in said


SEARCH = "search-e2e"


@pytest.fixture(scope="module")
def searched(tmp_path_factory, mlflow_server):
    """The search preset as documented, on the default 2 workers, made smaller (4 trials of 3
    epochs), run twice."""
    home = tmp_path_factory.mktemp("home")
    smaller = {
        "train": {"epochs": 3},
        "mlflow": {"model_name": SEARCH},
        # Three epochs a trial: the best is registered against a bar these short runs clear.
        "gate": [{"name": "min_metric", "options": {"threshold": 0.9}}, {"name": "quantization"}],
        "search": {"trials": 4, "startup_trials": 1},
    }
    args = ["--cfg", str(REPO / "configs/search-digits.yaml"), "--cfg", json.dumps(smaller)]
    target = ("workflows/search.py", "hyperparameter_search")
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    first = run_pipeline(home, *args, env=env, target=target)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = run_pipeline(home, *args, env=env, target=target)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return first.stdout, again.stdout


def _trials(out: str) -> list[tuple[int, bool, str, float, bool]]:
    """(number, best, state, value, from the cache) of each trial line of the search summary."""
    found = re.findall(r"^  trial +(\d+)([* ]) (complete|pruned) +val_loss ([\d.]+) (.*)$", out, re.M)
    return [(int(n), b == "*", s, float(v), rest.endswith("(from the cache)")) for n, b, s, v, rest in found]


@pytest.mark.timeout(900)
def test_a_search_finds_a_config_as_good_as_the_default_in_one_parent_run_and_registers_once(searched, mlflow_server):
    out, _ = searched
    trials = _trials(out)
    assert [t[0] for t in trials] == [0, 1, 2, 3] and not any(t[4] for t in trials)
    base = trials[0]  # the first trial is the base config, the digits preset's default learning rate and width
    (best,) = [t for t in trials if t[1]]
    assert best[2] == "complete" and best[3] <= base[3]
    assert best[3] == min(t[3] for t in trials if t[2] == "complete")
    client = MlflowClient(mlflow_server)
    parent = client.get_run(re.search(r"parent run (\w+)", out).group(1))
    assert parent.data.tags["flyscale.search"].startswith(f"{SEARCH}-search@")
    assert parent.info.status == "FINISHED" and parent.data.tags["flyscale.best_trial"] == str(best[0])
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    by_trial = {c.data.tags.get("flyscale.trial") for c in children}
    assert by_trial == {"0", "1", "2", "3", None}  # a child per trial, and the best config's pipeline run
    _assert_trial_runs(client, children, trials, replayed=False)
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "search")} >= {
        "search/trials.json",
        "search/best_config.json",
        "search/studies.db",
    }
    versions = client.search_model_versions(f"name='{SEARCH}'")
    assert len(versions) == 1 and versions[0].run_id == parent.data.tags["flyscale.pipeline_run"], out[-2500:]


def _assert_trial_runs(client: MlflowClient, children: list, trials: list, replayed: bool) -> None:
    """Each trial's child run as any run ends, so the compare view sets them side by side: FINISHED,
    its state a tag, the whole config it trained and its sampled values as params, a name of its own."""
    runs = {int(c.data.tags["flyscale.trial"]): c for c in children if "flyscale.trial" in c.data.tags}
    assert sorted(runs) == [t[0] for t in trials]
    for number, _, state, value, _ in trials:
        run = runs[number]
        assert run.info.status == "FINISHED", (number, run.info)
        assert run.data.tags["flyscale.trial_state"] == state
        params = run.data.params
        lr, hidden = json.loads(params["trial.train.lr"]), json.loads(params["trial.model.options.hidden"])
        assert float(params["train.lr"]) == lr and json.loads(params["model.options.hidden"]) == hidden
        assert params["train.epochs"] == "3" and params["mlflow.model_name"] == SEARCH  # the whole config
        assert (
            run.info.run_name
            == f"trial-{number:02d} lr={lr:.3g} hidden={json.dumps(hidden, separators=(',', ':'))}"
            + (" (replayed)" if replayed else "")
        )
        assert ("flyscale.replayed_from" in run.data.tags) == replayed
        curve = client.get_metric_history(run.info.run_id, "val_loss")  # its epochs' curves are there
        assert any(abs(m.value - value) < 1e-4 for m in curve), (number, value, curve)
    assert len({r.info.run_name for r in runs.values()}) == len(runs)


@pytest.mark.timeout(900)
def test_a_rerun_of_the_study_replays_every_trial_from_the_cache(searched, mlflow_server):
    out, again = searched
    assert [(t[0], t[2], t[3]) for t in _trials(again)] == [(t[0], t[2], t[3]) for t in _trials(out)]
    assert all(t[4] for t in _trials(again))  # every trial's training came from the cache
    client = MlflowClient(mlflow_server)
    parent = client.get_run(re.search(r"parent run (\w+)", again).group(1))
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    _assert_trial_runs(client, children, _trials(again), replayed=True)
    ran, cached = _cache_line(again)
    assert "train_model" in cached and "train_model" not in ran and "registration is the cached one" in again
    assert len(MlflowClient(mlflow_server).search_model_versions(f"name='{SEARCH}'")) == 1
