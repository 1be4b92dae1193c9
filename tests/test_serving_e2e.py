"""Serving a registered version with real servers on loopback, each in an environment uv builds
of its own requirements: `flyscale loadtest` against `mlflow models serve` and MLServer with
adaptive batching, logged to MLflow; MLServer really batching concurrent requests; a Triton
repository checked against Triton's config protobuf. (The registry e2e serves a version the
pipeline registered; here a model is registered directly, to keep the servers the subject.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from flyscale.serving import servers
from flyscale.serving.repository import Batching, mlserver_repository
from tests.registered import register

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "serve-e2e"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, Path]:
    """A tracking store with MODEL v1 registered as flyscale registers it (ONNX-served), and the
    folder the CLI runs in."""
    home = tmp_path_factory.mktemp("store")
    return register(home, MODEL), home


@pytest.fixture(scope="module")
def envs(serving_envs) -> Path:
    return serving_envs


def _flyscale(store, *args: str) -> subprocess.CompletedProcess:
    uri, home = store
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [str(BIN / "flyscale"), *args], cwd=home, env=env, capture_output=True, text=True, timeout=840
    )


def test_flyscale_loadtest_measures_each_setup_and_logs_the_table_and_plot(store, envs):
    proc = _flyscale(
        store,
        "loadtest",
        "--model",
        MODEL,
        "--setups",
        "mlflow,mlserver-batching",
        "--levels",
        "1,4",
        "--requests",
        "16",
        "--target-qps",
        "50",
        "--p99-ms",
        "5000",
        "--envs",
        str(envs),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip().startswith(("mlflow ", "mlserver-batching "))]
    rows = [r for r in rows if len(r) == 6]  # the table's; not the line that names the MLflow run
    assert [(r[0], r[1]) for r in rows] == [
        ("mlflow", "1"),
        ("mlflow", "4"),
        ("mlserver-batching", "1"),
        ("mlserver-batching", "4"),
    ]
    assert all(r[-1] == "0.0%" and float(r[4]) > 0 for r in rows), rows  # answered, every one
    assert "mlserver-batching: 50 req/s at p99 <= 5000 ms needs" in proc.stdout

    client = MlflowClient(store[0])
    run_id = client.get_model_version(MODEL, "1").tags["flyscale.loadtest_run"]
    artifacts = {a.path for a in client.list_artifacts(run_id, "loadtest")}
    assert {"loadtest/levels.json", "loadtest/latency_throughput.png", "loadtest/summary.txt"} <= artifacts
    metrics = client.get_run(run_id).data.metrics
    assert metrics["mlserver_batching_c4_error"] == 0 and metrics["mlflow_c1_latency_p99_ms"] > 0
    table = json.loads(Path(client.download_artifacts(run_id, "loadtest/levels.json", str(store[1]))).read_text())
    assert len(table["data"]) == 4 and "p99_ms" in table["columns"]


# A model whose every call takes 50 ms and answers, for each row, how many rows the call had.
ECHO = """
import time
import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel

class BatchSize(PythonModel):
    def predict(self, context, model_input, params=None):
        time.sleep(0.05)
        rows = np.asarray(model_input, dtype="float32")
        return np.full((len(rows), 1), float(len(rows)), dtype="float32")

mlflow.models.set_model(BatchSize())
"""


def _batch_sizes(base: str, name: str, clients: int) -> list[int]:
    """`clients` one-row requests at once; the batch size each was served in."""

    def ask(i: int) -> int:
        body = {"inputs": [{"name": "input-0", "shape": [1, 4], "datatype": "FP32", "data": [float(i)] * 4}]}
        request = urllib.request.Request(
            f"{base}/v2/models/{name}/infer", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return int(json.loads(r.read())["outputs"][0]["data"][0])

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(ask, range(clients)))


def test_mlserver_adaptive_batching_serves_concurrent_requests_as_one_batch(store, envs, tmp_path):
    code = tmp_path / "echo.py"
    code.write_text(ECHO)
    model_dir = tmp_path / "echo"
    # The store named explicitly: another module's test may have moved MLflow's global URI since.
    registered = mlflow.artifacts.download_artifacts(f"models:/{MODEL}/1", tracking_uri=store[0])
    requirements = servers.model_requirements(Path(registered))
    x = np.zeros((2, 4), dtype="float32")
    mlflow.pyfunc.save_model(
        str(model_dir),
        python_model=str(code),
        input_example=x,
        pip_requirements=requirements,  # the same environment
    )
    seen = {}
    for label, batching in (("on", Batching(16, 200)), ("off", Batching(1, 0))):
        repo = mlserver_repository(model_dir, tmp_path / f"repo-{label}", "echo", batching)
        with servers.mlserver(repo, envs) as base:
            _batch_sizes(base, "echo", 1)  # warm
            seen[label] = _batch_sizes(base, "echo", 8)
    assert max(seen["on"]) > 1, seen  # eight requests arriving together ran in fewer calls
    assert seen["off"] == [1] * 8, seen


def test_the_triton_repository_passes_tritons_config_checks(store, envs, tmp_path):
    out = tmp_path / "triton"
    proc = _flyscale(
        store, "repository", "--model", MODEL, "--server", "triton", "--out", str(out), "--max-batch-size", "16"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (out / MODEL / "config.pbtxt").read_text()
    assert "max_batch_size: 16" in config and "preferred_batch_size: [ 4, 8, 16 ]" in config
    assert (out / MODEL / "1" / "model.onnx").is_file()
    # Checked where tritonclient lives: the serving environment (MLServer depends on it).
    model_dir = Path(mlflow.artifacts.download_artifacts(f"models:/{MODEL}/1", tracking_uri=store[0]))
    python = servers.environment(sorted(set(servers.model_requirements(model_dir)) | set(servers.MLSERVER)), envs)
    check = [str(python), str(REPO / "infra" / "serving" / "check_triton_repository.py"), str(out)]
    ok = subprocess.run(check, capture_output=True, text=True)
    assert ok.returncode == 0 and "1 model(s) checked: ok" in ok.stdout, ok.stdout + ok.stderr

    (out / MODEL / "config.pbtxt").write_text(
        config.replace("preferred_batch_size: [ 4, 8, 16 ]", "preferred_batch_size: [ 4, 64 ]").replace(
            'name: "input"', 'name: "pixels"'
        )
    )
    bad = subprocess.run(check, capture_output=True, text=True)
    assert bad.returncode == 1, bad.stdout
    assert "preferred batch sizes [64] exceed max_batch_size 16" in bad.stdout
    assert "inputs ['pixels'] are not the ONNX file's ['input']" in bad.stdout
    (out / MODEL / "config.pbtxt").write_text(config.replace("max_batch_size", "max_batchsize"))
    typo = subprocess.run(check, capture_output=True, text=True)
    assert typo.returncode == 1 and "does not parse as Triton's ModelConfig" in typo.stdout, typo.stdout


def test_the_pipeline_load_tests_the_served_candidate_and_gates_on_it(tmp_path, serving_envs):
    """Rollout safety through `pyflyte run`: serving.loadtest serves the candidate before the
    gates, the served gate reads its p99, and the run records the table and the plot."""
    from tests.conftest import run_pipeline

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = {
        "augment": {"copies": 0},
        "train": {"epochs": 2, "batch_size": 64},
        "serving": {"loadtest": True, "levels": [1, 4], "requests": 16, "envs": str(serving_envs)},
        "gate": [
            {"name": "min_metric", "options": {"threshold": 0.5}},
            {"name": "served", "options": {"max_p99_ms": 10000, "at_concurrency": 4}},
        ],
        "mlflow": {"model_name": "served-gate-e2e"},
    }
    home = tmp_path / "home"
    home.mkdir()
    proc = run_pipeline(home, "--cfg", json.dumps(cfg), env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert (
        "served      mlserver-batching,  1 clients: p50" in out and "served      mlserver-batching,  4 clients" in out
    )
    assert "0 of 16 failed" in out
    assert "gate        served: PASSED (ONNX export's max difference from PyTorch" in out
    assert "registered  served-gate-e2e v1" in out
    client = MlflowClient(uri)
    run = client.get_run(client.get_model_version("served-gate-e2e", "1").run_id)
    assert run.data.metrics["served_c4_latency_p99_ms"] > 0 and run.data.metrics["served_c4_error"] == 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "loadtest")}
    assert {"loadtest/levels.json", "loadtest/latency_throughput.png"} <= artifacts
