"""Promotion on one fact, through real `pyflyte run` against a real MLflow server:
MLflow failing while gating or registering fails the run retryably with the registry unchanged;
two runs racing to promote move the alias once; a run after the champion changed re-judges; a
sweep leaves the best run champion."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from flyscale.config.publishing import GatesConfig
from flyscale.tracking import promotion
from tests.conftest import BIN, REPO, free_port, run_pipeline
from tests.faults import FaultProxy, after, fail_registry, fail_writes, training_workers

QUICK = {"augment": {"copies": 0}, "train": {"epochs": 4, "batch_size": 64}}


def _preset(tmp_path, model_name: str, **sections) -> str:
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.yaml"
    cfg = {**QUICK, "mlflow": {"experiment": "promotion", "model_name": model_name, "retries": 1}, **sections}
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _registry(client: MlflowClient, name: str) -> tuple[list[str], dict[str, str]]:
    """(versions, aliases) of a registered model, empty when it does not exist."""
    if not client.search_registered_models(f"name='{name}'"):
        return [], {}
    versions = sorted(str(v.version) for v in client.search_model_versions(f"name='{name}'"))
    return versions, dict(client.get_registered_model(name).aliases)


# (the case, the proxy's rule or None for a stopped server, what the error says MLflow was doing)
FAULTS = {
    "server stopped": (None, "reading the"),
    # Training's live run opens (runs/create), then the registry answers 503: the gate fails closed.
    "5xx on the registry once training runs (gating)": (after("runs/create", fail_registry), "reading the"),
    "5xx on writes (registering)": (fail_writes, "registering"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_mlflow_failing_fails_the_run_retryably_and_changes_nothing(tmp_path, mlflow_server, fault):
    name = f"faults-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server)
    rule, stage = FAULTS[fault]
    proxy = None
    if rule is None:
        uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    else:
        proxy = FaultProxy(mlflow_server, rule=rule)
        uri = proxy.url
    killed = "once training runs" in fault
    checkpoints = tmp_path / "checkpoints"
    # Training long enough to be hit mid-run, checkpointing often (see below).
    sections = (
        {
            "train": {"epochs": 16, "batch_size": 64},
            "recovery": {"checkpoint_every_steps": 10, "checkpoint_dir": str(checkpoints)},
        }
        if killed
        else {}
    )
    try:
        if not killed:
            proc = run_pipeline(
                tmp_path, "--cfg", _preset(tmp_path, name, **sections), env={"MLFLOW_TRACKING_URI": uri}, timeout=500
            )
            log = proc.stdout + proc.stderr
        else:
            # On the way, a training worker is killed (SIGKILL) once the first checkpoint is
            # written: torch-elastic restarts the group, which resumes from it and carries on
            # with the same live MLflow run, before the gate meets the failing registry.
            proc, log_path = _start(tmp_path, "killed", _preset(tmp_path, name, **sections), uri)
            deadline = time.monotonic() + 300
            while not list(checkpoints.glob("run-*/step-*[0-9]")):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.005)
            workers = training_workers(proc.pid)
            assert len(workers) == 2, workers
            os.kill(workers[1], signal.SIGKILL)  # local rank 1
            proc.wait(500)
            log = log_path.read_text()
    finally:
        if proxy is not None:
            proxy.close()
    assert proc.returncode != 0, log[-3000:]
    # Reads fail closed wherever MLflow is first met (the data reference, then the gate's champion).
    assert f"MLflow failed while {stage}" in log and "can be retried" in log, log[-4000:]
    assert "MlflowUnavailable" in log  # a FlyteRecoverableException: Flyte's retries apply
    assert _registry(client, name) == ([], {})
    live = re.search(r"training curves live in MLflow: run (\w+)", log)
    if killed:
        assert "resuming from checkpoint" in log and "(local): step " in log, log[-4000:]
        opened = re.findall(r"training curves live in MLflow: run (\w+).*", log)
        assert len(opened) == 2 and len(set(opened)) == 1 and "(continued)" in log, opened  # one run, continued
        assert not list(checkpoints.glob("run-*/step-*")), "training finished: its checkpoints should be gone"
        # The gate failed after training had opened the execution's run: the workflow's failure
        # handler ends it FAILED, with the error, instead of leaving it RUNNING.
        assert live, log[-4000:]
        run = client.get_run(live.group(1))
        assert run.info.status == "FAILED", run.info
        assert (
            "gate_model" in run.data.tags["flyscale.failure"] and "MLflow failed" in run.data.tags["flyscale.failure"]
        )
        assert run.data.metrics["val_accuracy"] > 0  # what training logged stays with it


def _start(tmp_path, tag: str, preset: str, uri: str) -> tuple[subprocess.Popen, object]:
    home = tmp_path / tag
    home.mkdir()
    log = open(home / "log.txt", "w")
    env = {**os.environ, "HOME": str(home), "MLFLOW_TRACKING_URI": uri, "COLUMNS": "400"}
    proc = subprocess.Popen(
        [str(BIN / "pyflyte"), "run", "workflows/train.py", "training_pipeline", "--cfg", preset],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, home / "log.txt"


@pytest.mark.timeout(900)
def test_two_runs_racing_to_promote_move_the_alias_once(tmp_path, mlflow_server):
    """Both are judged against "no champion", then meet at the promotion lock (held here until
    both wait at it): the first moves the alias, the second finds it moved and refuses."""
    name = f"race-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server)
    lock = name + promotion.LOCK_SUFFIX
    client.create_registered_model(lock, tags={"flyscale.acquired_at": str(time.time())})
    # Different seeds: two different candidates (identical weights would be the same model).
    runs = [
        _start(
            tmp_path,
            f"run{seed}",
            _preset(tmp_path, name, data={"seed": seed}, train={**QUICK["train"], "seed": seed}),
            mlflow_server,
        )
        for seed in (1, 2)
    ]
    try:
        deadline = time.time() + 600
        while not all(f"waiting for '{lock}'" in path.read_text() for _, path in runs):
            assert time.time() < deadline and all(p.poll() is None for p, _ in runs), [
                p.read_text()[-2000:] for _, p in runs
            ]
            time.sleep(1)
        client.delete_registered_model(lock)
        outs = []
        for proc, path in runs:
            proc.wait(timeout=300)
            outs.append(path.read_text())
            assert proc.returncode == 0, outs[-1][-4000:]
    finally:
        for proc, _ in runs:
            proc.kill() if proc.poll() is None else None
    moved = [o for o in outs if "alias 'champion' -> these versions" in o]
    refused = [o for o in outs if "alias 'champion' NOT moved" in o]
    assert len(moved) == 1 and len(refused) == 1
    winner = re.search(r"registered\s+\S+ v(\d+)", moved[0]).group(1)
    assert f"promotion   not promoted: 'champion' moved from no champion to v{winner}" in refused[0]
    versions, aliases = _registry(client, name)
    assert len(versions) == 2 and aliases == {"champion": winner}


@pytest.mark.timeout(900)
def test_a_run_after_the_champion_changed_re_judges_instead_of_replaying(tmp_path, mlflow_server):
    name = f"rejudge-{uuid.uuid4().hex[:6]}"
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    preset = _preset(tmp_path, name, gate={"name": "beats_champion"})
    first = run_pipeline(tmp_path, "--cfg", preset, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "beats_champion: PASSED (no champion yet" in first.stdout

    # Someone else's model takes the alias: a better one, from another run.
    client = MlflowClient(mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("promotion")
    with mlflow.start_run() as other:
        mlflow.log_metrics({"test_accuracy": 0.999, "test_macro_f1": 0.999})
    better = client.create_model_version(
        name, f"runs:/{other.info.run_id}/m", other.info.run_id, tags={"flyscale.run_id": other.info.run_id}
    )
    client.set_registered_model_alias(name, "champion", better.version)

    again = run_pipeline(tmp_path, "--cfg", preset, env=env)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-4000:]
    # Training was not repeated, but the judgment was: against the new champion, not replayed (and the
    # shards were combined again, against the new champion's reference; the same rows re-ran nothing).
    ran = (
        "cache       ran combine_shards, augment_data, record_candidate; from the cache: prepare_shard, preflight_check"
    )
    assert ran in again.stdout, again.stdout[-3000:]
    # That "model" is no model anyone can load: it cannot be scored on this run's test split, so
    # the gate fails closed, and says why, rather than compare numbers from two test sets.
    assert (
        f"beats_champion: FAILED (champion v{better.version} could not be scored on this run's test split"
        in again.stdout
        and "failing closed" in again.stdout
    ), again.stdout[-3000:]
    assert f"test data   champion v{better.version} could not be scored on this run's test split (" in again.stdout
    assert "it is not a flyscale model" in again.stdout
    assert f"judged      against v{better.version}" in again.stdout
    assert client.get_registered_model(name).aliases == {"champion": better.version}
    # The failed candidate took the other branch: its run and both its models are logged for
    # inspection, with the verdict, and no version is registered.
    assert "registered  no version" in again.stdout and "not registered: a gate failed" in again.stdout
    assert "record_candidate" in again.stdout and "register_model" not in again.stdout
    run = client.get_run(re.search(r"mlflow\s+run (\w+)", again.stdout).group(1))
    assert run.data.tags["flyscale.gates"] == "failed"
    assert run.data.tags["gate.beats_champion"].startswith(f"failed: champion v{better.version} could not be scored")
    logged = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
    )
    assert sorted(m.name for m in logged) == ["model", "model_int8"]
    assert sorted(v.version for v in client.search_model_versions(f"name='{name}'")) == ["1", better.version]


@pytest.mark.timeout(900)
def test_a_sweep_with_the_default_gates_leaves_the_best_run_champion(tmp_path, mlflow_server):
    """Two learning rates, one after the other, through the default gates (min_metric's bar
    lowered so that both pass it): the champion is the run with the better test accuracy. The
    second run is the worse, so "the latest passing run wins" fails here. (A later run that beats
    the champion taking the alias is test_registry_e2e's.)"""
    gates = [{"name": g.name, "options": g.options} for g in GatesConfig().gates]
    assert [g["name"] for g in gates] == ["min_metric", "beats_champion", "quantization"]
    gates[0]["options"] = {"threshold": 0.85}
    name = f"sweep-{uuid.uuid4().hex[:6]}"
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    client = MlflowClient(mlflow_server)
    accuracy = {}
    for lr in (5e-3, 2e-2):
        preset = _preset(tmp_path, name, gate=gates)
        champion_before = client.get_model_version_by_alias(name, "champion") if accuracy else None
        proc = run_pipeline(tmp_path, "--cfg", preset, "--cfg", f'{{"train": {{"lr": {lr}}}}}', env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        run = client.get_run(re.search(r"mlflow\s+run (\w+)", proc.stdout).group(1))
        assert float(run.data.params["train.lr"]) == lr
        accuracy[lr] = run.data.metrics["test_accuracy"]
        if champion_before is not None:
            # The champion scored on this run's test split through its registered (ONNX) model: the
            # same split as its own here, so the number it recorded, to the last digit.
            recorded = client.get_run(champion_before.run_id).data.metrics["test_accuracy"]
            assert run.data.metrics["champion_test_accuracy"] == pytest.approx(recorded, abs=1e-9)
            assert (
                f"vs champion v{champion_before.version} {recorded:.4f}, both on this run's test split" in proc.stdout
            )
            assert "the metrics it recorded are from the same split" in run.data.tags["flyscale.test_data"]
    assert accuracy[2e-2] < max(accuracy.values()), accuracy
    champion = client.get_model_version_by_alias(name, "champion")
    assert client.get_run(champion.run_id).data.metrics["test_accuracy"] == max(accuracy.values()), accuracy
    # Only a run that beat the champion of its day was registered.
    assert len(client.search_model_versions(f"name='{name}'")) == 1
