"""Model servers on loopback, each in an environment of its own, as they would be deployed.

- `mlflow_serve`: `mlflow models serve --env-manager uv`: MLflow's scoring server in an
  environment uv builds from the model's own requirements. No request batching.
- `mlserver`: MLServer with its MLflow runtime, in an environment of MLServer and the model's
  requirements (MLServer pins a FastAPI and protobuf that flyscale's own environment cannot
  share), serving a repository made by `repository.mlserver_repository`; adaptive batching as
  its model-settings say.

Environments are built once with uv and kept under `root`, keyed by what they install.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# The batching server and its MLflow runtime, checked against the registered model's own pins.
MLSERVER = ("mlserver==1.7.1", "mlserver-mlflow==1.7.1")


class ServerError(RuntimeError):
    """A server did not come up, or its environment could not be built."""


def uv() -> str:
    """The uv executable: beside this Python (a dev dependency of flyscale) or on the PATH."""
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        raise ServerError("serving environments are built with uv: `pip install uv`, then run again")
    return found


def environment(requirements: list[str], root: Path) -> Path:
    """A virtual environment with `requirements` installed (built once), and its python.

    Built under a lock beside it (two load tests wanting the same one: the second waits for the
    first's and uses it), in a temporary directory renamed into place when complete, so that no
    one ever sees, uses or deletes another's half-built environment. Relocatable (uv's
    `--relocatable`): its scripts find their python beside them after the rename."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    home = root / f"serving-{key}"
    python = home / "bin" / "python"
    if (home / ".complete").exists():
        return python
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"serving-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if (home / ".complete").exists():  # built while this one waited
            return python
        shutil.rmtree(home, ignore_errors=True)  # incomplete: left by an older flyscale, built in place
        with tempfile.TemporaryDirectory(prefix=f".serving-{key}-", dir=root) as tmp:
            building = Path(tmp) / "env"
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            steps = [
                [uv(), "venv", "-q", "--relocatable", "-p", version, str(building)],
                [uv(), "pip", "install", "-q", "--python", str(building / "bin" / "python"), *requirements],
            ]
            for step in steps:
                proc = subprocess.run(step, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise ServerError(
                        f"building the serving environment {home} failed ({' '.join(step[:3])}): {proc.stderr[-2000:]}"
                    )
            (building / ".complete").write_text("\n".join(requirements) + "\n")
            building.rename(home)
    return python


def model_requirements(model_dir: Path) -> list[str]:
    """The pins an MLflow model declares (its requirements.txt)."""
    lines = (model_dir / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "-"))]


def free_port() -> int:
    """A loopback port that nothing holds now, from below the kernel's ephemeral range.

    A port the kernel picks (bind to port 0) comes from the range it also gives every outgoing
    connection, so between our closing it and the server binding it another process's
    connection can take it (EADDRINUSE). Below that range only a process naming the port can.
    """
    top = _ephemeral_ports_start()
    if top - _LOWEST_PORT < 1000:  # an unusual kernel setting: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    choose = random.SystemRandom()
    for _ in range(200):
        port = choose.randrange(_LOWEST_PORT, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port between {_LOWEST_PORT} and {top}")


_LOWEST_PORT = 10_000


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's setting; 32768 elsewhere, below
    macOS's and Windows' 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {timeout_s:.0f} s"
            raise ServerError(f"the server {state}; its log ends:\n{tail}")
        time.sleep(0.5)


@contextlib.contextmanager
def _process(cmd: list[str], ready: str, cwd: Path, env: dict, timeout_s: float) -> Iterator[subprocess.Popen]:
    log = Path(tempfile.mkdtemp(prefix="flyscale-server-")) / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(ready, proc, log, timeout_s)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@contextlib.contextmanager
def mlserver(repository: Path, root: Path, timeout_s: float = 600) -> Iterator[str]:
    """MLServer serving `repository` on a free loopback port; yields its base URL."""
    models = [p for p in repository.iterdir() if (p / "model-settings.json").exists()]
    needs = sorted({r for m in models for r in model_requirements(m / "model")} | set(MLSERVER))
    python = environment(needs, root)
    port = free_port()
    settings = json.loads((repository / "settings.json").read_text())
    settings.update(http_port=port, grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1")
    (repository / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    cmd = [str(python.parent / "mlserver"), "start", str(repository)]
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    base = f"http://127.0.0.1:{port}"
    with _process(cmd, f"{base}/v2/health/ready", repository, env, timeout_s):
        yield base


@contextlib.contextmanager
def mlflow_serve(model_uri: str, root: Path, timeout_s: float = 600) -> Iterator[str]:
    """`mlflow models serve --env-manager uv` on a free loopback port; yields its base URL."""
    port = free_port()
    here = Path(sys.executable).parent
    env = {**os.environ, "MLFLOW_ENV_ROOT": str(root), "PATH": f"{here}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [str(here / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "uv", "-p", str(port)]
    base = f"http://127.0.0.1:{port}"
    with _process(cmd, f"{base}/ping", Path.cwd(), env, timeout_s):
        yield base
