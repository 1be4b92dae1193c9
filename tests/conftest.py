"""Shared fixtures: real servers on loopback (MLflow, moto's S3) and a runner for real `pyflyte run`."""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flyscale.serving.servers import free_port  # the tests' servers and process groups bind by it

REPO = Path(__file__).resolve().parents[1]

# Tests train on the 2 workers FLYSCALE_NPROC_PER_NODE=auto (the default) times against one
# process, not on auto's choice: a timing on these shared machines picks either, and would cost
# every run a preflight. Tests of auto itself unset it (test_preflight.py, test_regression.py).
os.environ.setdefault("FLYSCALE_NPROC_PER_NODE", "2")
# Every run_pipeline gets a HOME of its own (a cold Flyte cache), but the answers flyscale keeps
# between processes (flyscale/flyte/memo.py: parsed imports, type schemas) are keyed on content,
# so one folder serves the whole session, as ~/.cache/flyscale serves a user's runs.
# tests/test_memo.py gives its processes folders of their own.
if "FLYSCALE_CACHE_DIR" not in os.environ:  # this file is imported twice (conftest, tests.conftest): one folder
    os.environ["FLYSCALE_CACHE_DIR"] = tempfile.mkdtemp(prefix="flyscale-memo-")
BIN = Path(sys.executable).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end files (whole pipelines, minutes each) first, then the other files by how
    many slow tests they hold, most first, so that the small ones fill the gaps at the end. This
    is the order of a plain `pytest` run and of `make test` (`--dist loadfile
    --no-loadscope-reorder`: without the flag xdist hands files out by how many tests each holds).

    Every test of an end-to-end file is `slow`, as are the tests marked so by hand (those that
    start processes, servers or whole trainings: seconds each): `make test-fast` runs the rest."""
    slow: collections.Counter[Path] = collections.Counter()
    for item in items:
        if item.path.name.endswith("_e2e.py"):
            item.add_marker(pytest.mark.slow)
        slow[item.path] += item.get_closest_marker("slow") is not None
    # stable: each file's own order kept
    items.sort(key=lambda item: (not item.path.name.endswith("_e2e.py"), -slow[item.path], str(item.path)))


@contextlib.contextmanager
def serve(cmd: list[str], ready_url: str, log: Path, timeout: float, env: dict | None = None) -> Iterator[None]:
    """Run a server process (in `env`, default this one's) until the block ends; enter only once
    `ready_url` answers."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(ready_url, timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"{cmd[0]} did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.3)
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


# MLflow 3's server also starts a job runner and seven huey consumers for its GenAI jobs, which
# flyscale never schedules: about twice the server's own start-up CPU, and each polls while it
# idles. The tests' servers run without them (the REST API and the registry are the same).
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@contextlib.contextmanager
def mlflow_server_at(root: Path) -> Iterator[str]:
    """A real MLflow tracking server with a SQLite backend, its files under `root`, until the
    block ends; yields its URI. (The benchmarks start theirs with this too.)"""
    uri = f"http://127.0.0.1:{free_port()}"
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        uri.rsplit(":", 1)[1],
        "--workers",
        "1",
    ]
    with serve(cmd, f"{uri}/health", root / "server.log", timeout=120, env={**os.environ, **SERVER_ENV}):
        yield uri


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server for the session; yields its URI."""
    with mlflow_server_at(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


@pytest.fixture(scope="session")
def serving_envs(tmp_path_factory) -> Path:
    """Where fresh environments of a model's declared requirements are built (uv, from the
    package index), once per test session: flyscale.serving.servers.environment."""
    return tmp_path_factory.mktemp("serving-envs")


def fresh_python(model_dir: Path, root: Path) -> Path:
    """The python of an environment with nothing but what the MLflow model in `model_dir` declares."""
    from flyscale.serving import servers

    return servers.environment(servers.model_requirements(model_dir), root)


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """A real S3-compatible server (moto's server mode); yields its endpoint URL."""
    root = tmp_path_factory.mktemp("moto")
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "moto.server", "-p", url.rsplit(":", 1)[1], "-H", "127.0.0.1"]
    with serve(cmd, f"{url}/moto-api/", root / "moto.log", timeout=60):
        yield url


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """A boto3 client on the moto server and a fresh bucket, with the AWS environment flyscale reads."""
    import boto3

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3")
    bucket = f"flyscale-{time.monotonic_ns()}"  # fresh bucket per test: nothing leaks between tests
    client.create_bucket(Bucket=bucket)
    return client, bucket


PIPELINE = ("workflows/train.py", "training_pipeline")
NIGHTLY = ("workflows/launch_plans.py", "nightly_retraining")  # its inputs: FLYSCALE_PRODUCTION_CONFIG


def run_pipeline(
    home: Path,
    *args: str,
    env: dict | None = None,
    timeout: int = 600,
    target: tuple[str, str] = PIPELINE,
    run_flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """`pyflyte run RUN_FLAGS workflows/train.py training_pipeline ARGS` (or another file and
    entity) from the repo root, as a user types it (`run_flags`, such as --overwrite-cache, go
    before the file).

    HOME isolates flytekit's local cache (~/.flyte/local-cache) per test.
    """
    # COLUMNS: pyflyte boxes a usage error at the terminal's width; wide, a message stays on one line.
    full_env = {**os.environ, "HOME": str(home), "FLYTE_SDK_LOGGING_LEVEL": "20", "COLUMNS": "400", **(env or {})}
    return subprocess.run(
        [str(BIN / "pyflyte"), "run", *run_flags, *target, *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
