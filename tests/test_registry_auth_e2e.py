"""A registry only the pipeline can write, and secrets that never leave their variable, against a
real MLflow server running its basic-auth app on loopback, with users made through its REST API:

- `flyscale promote` with no credentials, a wrong password, or a user that may only read is
  refused in one line that names what to do and holds no password; the pipeline's user moves
  `champion`.
- one search through `pyflyte run` (which ends in the training pipeline and its registration),
  with the pipeline user's password planted in MLFLOW_TRACKING_URI and a secret in the Optuna
  storage variable: neither is found in anything the run printed, wrote or recorded."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from flyscale import cli
from tests.conftest import BIN, REPO, SERVER_ENV, free_port, run_pipeline, serve

CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_URI")


@dataclass
class AuthServer:
    uri: str  # no credentials in it
    root: Path
    users: dict[str, str]  # name -> password; "pipeline" owns what it creates, "reader" may only read


@contextlib.contextmanager
def auth_mlflow_server(root: Path) -> Iterator[AuthServer]:
    """`mlflow server --app-name basic-auth` with its own user database, configured as infra/
    configures it (default_permission READ, admin password from the environment)."""
    admin = secrets.token_hex(16)
    (root / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root / 'auth.db'}\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # PBKDF2 costs each request about a second of these shared CPUs: checked once a user.
        "auth_cache_ttl_seconds = 600\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIALS}
    env |= {
        "MLFLOW_AUTH_CONFIG_PATH": str(root / "basic_auth.ini"),
        "MLFLOW_AUTH_ADMIN_PASSWORD": admin,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{root / 'mlflow.db'}",
        **SERVER_ENV,
    }
    uri = f"http://127.0.0.1:{free_port()}"
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--app-name",
        "basic-auth",
        "--artifacts-destination",
        str(root / "artifacts"),
    ]
    cmd += ["--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1], "--workers", "1"]
    with serve(cmd, f"{uri}/health", root / "server.log", timeout=120, env=env):
        users = {"pipeline": f"planted-{secrets.token_hex(12)}", "reader": secrets.token_hex(12)}
        for name, password in users.items():  # the auth app's REST API, as an admin uses it
            made = requests.post(
                f"{uri}/api/2.0/mlflow/users/create",
                json={"username": name, "password": password},
                auth=("admin", admin),
                timeout=30,
            )
            assert made.status_code == 200, made.text
        yield AuthServer(uri, root, users)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[AuthServer]:
    with auth_mlflow_server(tmp_path_factory.mktemp("auth-mlflow")) as running:
        yield running


@contextlib.contextmanager
def signed_in(monkeypatch, user: str = "", password: str = "", uri: str = "") -> Iterator[None]:
    """Only these credentials in this process's environment while the block runs, and none of
    what flyscale put there from them (it moves a URI's password into MLflow's variables) after."""
    with monkeypatch.context() as m:
        for name in CREDENTIALS:
            m.setenv(name, "")  # recorded, so that the block's end removes what was set meanwhile
            m.delenv(name)
        m.setenv("MLFLOW_TRACKING_URI", uri)
        if user:
            m.setenv("MLFLOW_TRACKING_USERNAME", user)
            m.setenv("MLFLOW_TRACKING_PASSWORD", password)
        yield


def _two_versions(server: AuthServer, monkeypatch) -> str:
    """A registered model the pipeline's user made, v1 `champion` and v2 beside it."""
    name = f"auth-{uuid.uuid4().hex[:6]}"
    with signed_in(monkeypatch, "pipeline", server.users["pipeline"], server.uri):
        client = MlflowClient(server.uri)
        experiment = client.create_experiment(name)
        run = client.create_run(experiment).info.run_id
        client.create_registered_model(name)
        for _ in range(2):
            client.create_model_version(name, f"runs:/{run}/model", run)
        client.set_registered_model_alias(name, "champion", "1")
    return name


def _promote(capsys, model: str) -> tuple[int, list[str]]:
    """`flyscale promote` to v2: its exit code and what it said, but the 'tracking store' line."""
    rc = cli.main(["promote", "--model", model, "--version", "2", "--reason", "auth test", "--who", "tester"])
    out, err = capsys.readouterr()
    said = [line for line in (out + err).splitlines() if line.strip() and not line.startswith("tracking store:")]
    return rc, said


def _champion(server: AuthServer, monkeypatch, model: str) -> str:
    with signed_in(monkeypatch, "reader", server.users["reader"], server.uri):
        return MlflowClient(server.uri).get_model_version_by_alias(model, "champion").version


def test_promotion_needs_a_user_who_may_write(server, monkeypatch, capsys, tmp_path):
    model = _two_versions(server, monkeypatch)
    capsys.readouterr()  # MLflow's own notes while the versions were made
    refused = {
        "no credentials": ("", "", "needs an MLflow user, and none was given. Export MLFLOW_TRACKING_USERNAME"),
        "a wrong password": ("pipeline", "not-the-password", "user 'pipeline' with the password given was not"),
        "a user who may only read": ("reader", server.users["reader"], "MLflow user 'reader' may not do this"),
    }
    for case, (user, password, reason) in refused.items():
        with signed_in(monkeypatch, user, password, server.uri):
            rc, said = _promote(capsys, model)
        assert rc == 1, (case, said)
        assert len(said) == 1 and reason in said[0], (case, said)  # one line, what to do
        assert not any(p in said[0] for p in (password or "-", *server.users.values())), (case, said)
        assert _champion(server, monkeypatch, model) == "1", case
    # The pipeline's user, its password in the URI as a user may write it: promoted, and the
    # password printed nowhere (the URI is shown without it).
    host = server.uri.removeprefix("http://")
    with signed_in(monkeypatch, uri=f"http://pipeline:{server.users['pipeline']}@{host}"):
        rc, said = _promote(capsys, model)
    assert rc == 0, said
    assert _champion(server, monkeypatch, model) == "2"
    assert not any(server.users["pipeline"] in line for line in said), said
    # On a cluster the credentials are the Flyte secret "mlflow", mounted as files where Flyte's
    # webhook puts them (FLYTE_SECRETS_DEFAULT_DIR): with nothing else, they sign the pipeline in.
    mounted = tmp_path / "secrets" / "mlflow"
    mounted.mkdir(parents=True)
    (mounted / "tracking_username").write_text("pipeline\n")
    (mounted / "tracking_password").write_text(server.users["pipeline"] + "\n")
    with signed_in(monkeypatch, uri=server.uri):
        monkeypatch.setenv("FLYTE_SECRETS_DEFAULT_DIR", str(tmp_path / "secrets"))
        rc = cli.main(["rollback", "--model", model, "--to", "1", "--reason", "auth test", "--who", "tester"])
    assert rc == 0, capsys.readouterr()
    assert _champion(server, monkeypatch, model) == "1"


# --- one search with planted secrets, every output searched --------------------------------


def _forms(secret: str, user: str = "") -> list[bytes]:
    """The ways a secret could be written down: as is, URL-quoted, and inside a Basic auth header."""
    forms = {secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret)}
    if user:
        forms.add(base64.b64encode(f"{user}:{secret}".encode()).decode())
    return [f.encode() for f in forms]


def _files(root: Path, skip: tuple[Path, ...] = (), since: float = 0.0) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip and d not in {".git", ".venv", "node_modules"}]
        for f in filenames:
            path = here / f
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= since:
                    yield path


@pytest.mark.timeout(900)
def test_a_planted_password_is_found_in_no_output_of_a_run(server, tmp_path):
    password = server.users["pipeline"]
    storage_secret = f"storage-secret-{secrets.token_hex(8)}"
    storage_dir = tmp_path / storage_secret  # the storage URL's value: only its variable names it
    storage_dir.mkdir()
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(), tmp.mkdir()
    preset = {
        "augment": {"copies": 0},
        "train": {"epochs": 2, "batch_size": 64},
        "preflight": {"enabled": False},
        "mlflow": {"experiment": "planted", "model_name": f"planted-{uuid.uuid4().hex[:6]}"},
        "gate": [{"name": "min_metric", "options": {"threshold": 0.5}}, {"name": "quantization"}],
        "search": {
            "trials": 2,
            "concurrency": 2,
            "pruner": "none",
            "storage_env": "OPTUNA_STORAGE",
            "space": {"train.lr": {"low": 1e-3, "high": 3e-2, "log": True}},
        },
    }
    env = {
        "MLFLOW_TRACKING_URI": f"http://pipeline:{password}@{server.uri.removeprefix('http://')}",
        "OPTUNA_STORAGE": f"sqlite:///{storage_dir / 'studies.db'}",
        "TMPDIR": str(tmp),  # flytekit's local sandbox (every task's inputs and outputs), workers' logs
    }
    assert not any(os.environ.get(name) for name in CREDENTIALS[:3])  # the URI is the only way in
    started = time.time()
    args = ["--cfg", str(REPO / "configs/quick.yaml"), "--cfg", json.dumps(preset)]
    done = run_pipeline(home, *args, env=env, target=("workflows/search.py", "hyperparameter_search"), timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "registered  " in done.stdout and (storage_dir / "studies.db").is_file()  # it did run through both

    # What the run recorded in MLflow, as a reader downloads it: every run's params, tags, metrics
    # names and artifacts, and the registered versions' tags and descriptions.
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    reader = MlflowClient(server.uri)
    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = "reader", server.users["reader"]
    try:
        experiment = reader.get_experiment_by_name("planted")
        runs = reader.search_runs([experiment.experiment_id])
        assert runs
        for run in runs:
            (recorded / f"{run.info.run_id}.json").write_text(json.dumps(run.to_dictionary(), default=str))
            reader.download_artifacts(run.info.run_id, "", str(recorded))
        versions = reader.search_model_versions(f"name='{preset['mlflow']['model_name']}'")
        assert versions, done.stdout[-2000:]  # registration signed in with the URI's password
        for version in versions:
            (recorded / f"v{version.version}.json").write_text(json.dumps(vars(version), default=str))
    finally:
        del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]

    outputs: dict[str, bytes] = {"pyflyte run stdout": done.stdout.encode(), "pyflyte run stderr": done.stderr.encode()}
    for root in (home, tmp, recorded, server.root):  # the server's own stores: runs, artifacts, its log
        for path in _files(root, skip=(storage_dir,)):
            outputs[str(path)] = path.name.encode() + b"\n" + path.read_bytes()
    for path in _files(REPO, since=started):  # anything the run left in the working tree
        outputs[str(path)] = path.name.encode() + b"\n" + path.read_bytes()
    planted = _forms(password, "pipeline") + _forms(storage_secret)
    found = [where for where, data in outputs.items() if any(form in data for form in planted)]
    print(f"a planted password found in {len(found)} of {len(outputs)} outputs")
    assert len(outputs) > 50, sorted(outputs)  # the run's files were searched, not an empty folder
    assert not found, found


def test_a_refused_task_fails_for_good_instead_of_retrying(server, monkeypatch):
    """A pipeline task MLflow refuses (the gate reading the champion, here) fails with what to do;
    a retry signs nobody in, so it is no FlyteRecoverableException."""
    from flytekit.exceptions.user import FlyteRecoverableException

    from flyscale.config import MlflowConfig
    from flyscale.tracking import champion, store

    with signed_in(monkeypatch, uri=server.uri), pytest.raises(store.MlflowRefused) as refused:
        champion.read_baseline(MlflowConfig(model_name="anything", retries=0), "0" * 64)
    assert "MLflow refused reading the 'champion' of 'anything': the server at" in str(refused.value)
    assert "none was given" in str(refused.value)
    assert not isinstance(refused.value, FlyteRecoverableException)
