"""Shared fixtures: a real `mlflow server` process and a runner for real `pyflyte run`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on loopback with a SQLite backend; yields its URI."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"), "server",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        ],
        stdout=open(root / "server.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_pipeline(home: Path, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`pyflyte run workflows/train.py training_pipeline ARGS` from the repo root, as a user types it.

    HOME isolates flytekit's local cache (~/.flyte/local-cache) per test.
    """
    full_env = {**os.environ, "HOME": str(home), "FLYTE_SDK_LOGGING_LEVEL": "20", **(env or {})}
    return subprocess.run(
        [str(BIN / "pyflyte"), "run", "workflows/train.py", "training_pipeline", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """A real S3-compatible server (moto's server mode) on loopback; yields its endpoint URL."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
