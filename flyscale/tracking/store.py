"""Where runs go and how flyscale talks to it: the tracking URI, MLflow's client settings from
config, the model-training experiment, run names, the tags flyscale reads back, and MLflow's
failures as one retryable error."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from flytekit.exceptions.user import FlyteRecoverableException

from flyscale.config import MlflowConfig

log = logging.getLogger(__name__)


DEFAULT_STORE = "mlflow.db"


# What MLflow 3 records an experiment's kind in. (MLflow 3.17's UI still opens every experiment
# on the GenAI overview unless the URL says ?workflowType=machine_learning: the summary prints that URL.)
KIND_TAG = "mlflow.experimentKind"


TRAINING_KIND = "custom_model_development"


DATA_TAG = "flyscale.data_sha256"  # on each version: the content fingerprint of the data it was trained on


REFERENCE_TAG = "flyscale.reference_version"  # on each version: the version whose reference its data met


# On each version: where its own data's reference.json is. Read straight from there, a cached run
# does not load the whole run (every metric, param and tag: 0.3 s from SQLite) to find one file.
REFERENCE_URI_TAG = "flyscale.reference_uri"


EXECUTION_TAG = "flyscale.execution"  # on each run: the pipeline execution (provenance.execution_key)


# The pipeline's MLflow user on a cluster: a Flyte secret (a Kubernetes Secret "mlflow" in the
# task's namespace, infra/README.md), requested only by the tasks that talk to MLflow. Locally
# flytekit reads a requested secret from the variable GROUP_KEY, which makes these MLflow's own
# MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD: a local run needs nothing but those.
SECRET_GROUP = "mlflow"
SECRET_KEYS = {"MLFLOW_TRACKING_USERNAME": "tracking_username", "MLFLOW_TRACKING_PASSWORD": "tracking_password"}


def secret_requests() -> list:
    """The Flyte secrets a task that talks to MLflow declares (`@task(secret_requests=...)`):
    mounted as files into that task's pod only, and read into MLflow's variables in its process
    when it first talks to MLflow (`_sign_in`)."""
    from flytekit import Secret

    return [
        Secret(group=SECRET_GROUP, key=key, mount_requirement=Secret.MountType.FILE) for key in SECRET_KEYS.values()
    ]


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set, else a SQLite store in the working directory; with the
    credentials MLflow's HTTP client needs in its own variables, never in the URI (see `_sign_in`)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_STORE}"
    return _sign_in(uri)


def _sign_in(uri: str) -> str:
    """`uri` without a password, the password in MLFLOW_TRACKING_USERNAME/PASSWORD instead.

    MLflow prints a server's URI ("View run ... at http://user:secret@host/#/...") and flyscale
    records it, so a password in `https://user:secret@host` moves out of it, here, in this process
    (a database URI keeps its password: SQLAlchemy has no other place for it, and MLflow prints
    none). With no credentials exported, those of the Flyte secret (`secret_requests`) are used.
    """
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(uri)
        user, secret = parts.username, parts.password
    except ValueError:  # a bad port: MLflow says so when it is used; nothing to move
        return uri
    if parts.scheme not in ("http", "https"):  # a database or a file: no HTTP client signs in
        return uri
    if secret is not None:
        if not os.environ.get("MLFLOW_TRACKING_USERNAME"):  # credentials exported apart win
            os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(user or "")
            os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(secret)
        uri = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
        os.environ["MLFLOW_TRACKING_URI"] = uri  # what MLflow reads where flyscale does not pass it
    if not any(os.environ.get(v) for v in (*SECRET_KEYS, "MLFLOW_TRACKING_TOKEN")):
        os.environ.update(_flyte_secrets())
    return uri


def _flyte_secrets() -> dict[str, str]:
    """MLflow's credentials from the Flyte secret, where this task was given it; {} elsewhere."""
    from flytekit.core.context_manager import SecretsManager

    secrets = SecretsManager()
    found = {}
    for variable, key in SECRET_KEYS.items():
        try:
            found[variable] = secrets.get(SECRET_GROUP, key)
        except ValueError:  # not requested by this task, or not on this cluster: MLflow says 401
            return {}
    return found


def shown(uri: str) -> str:
    """`uri` as it may be printed and recorded: a password in it (`https://user:secret@host`,
    `postgresql://user:secret@db/mlflow`) as `***`. The real one is only ever read from the
    environment, where it is used."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(uri)
        secret = parts.password
    except ValueError:  # not a URL this parser can read (a bad port): nothing of it is shown
        return "<a tracking URI that is not a valid URL>"
    if secret is None:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def missing_local_store(uri: str) -> str:
    """Why `uri` names no store yet, for a command that only reads or moves what is there: a
    SQLite file that does not exist (MLflow would create it, empty). "" when there is one, or
    when it is a server's to say."""
    if not uri.startswith("sqlite:///"):
        return ""
    path = Path(uri[len("sqlite:///") :])
    if path.is_file():
        return ""
    return (
        f"there is no tracking store at {path} (none was created). Run from the directory where the pipeline "
        f"ran, or point MLFLOW_TRACKING_URI at your store: MLFLOW_TRACKING_URI=http://mlflow:5000 flyscale ..."
    )


# MLflow draws a tqdm bar for each artifact download (four of them, one per file, each time
# log_model validates its input example). Inside a task nobody watches them: remotely they fill
# the pod's log, locally they cut into the run's log lines. MLflow 3.17 has no setting for it but
# this variable, which it reads on every download.
QUIET_ARTIFACTS = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


@contextlib.contextmanager
def _environment(wanted: dict[str, str]) -> Iterator[None]:
    """`wanted` in os.environ while the block runs, then removed; values the user exported win."""
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def quiet_artifacts() -> contextlib.AbstractContextManager[None]:
    """No MLflow artifact progress bars while the block runs (unless the user asked for them)."""
    return _environment(QUIET_ARTIFACTS)


def client_settings(cfg: MlflowConfig) -> contextlib.AbstractContextManager[None]:
    """MLflow's HTTP retries bounded as configured (its defaults retry for about four minutes),
    and no artifact progress bars.

    MLflow reads these variables on every request; values the user exported win.
    """
    return _environment(
        {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(cfg.retries),
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(cfg.retry_backoff_s),
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(cfg.request_timeout_s),
            **QUIET_ARTIFACTS,
        }
    )


def _metric_name(text: str) -> str:
    """MLflow names allow letters, digits and _-./ and spaces only."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in text)


def use_experiment(client, name: str) -> str:
    """The experiment's id, created as a model-training experiment (MLflow's kind tag); an
    existing one without a kind gets it."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, tags={KIND_TAG: TRAINING_KIND})
        except MlflowException as exc:  # created by a concurrent run meanwhile
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
    if KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, KIND_TAG, TRAINING_KIND)
    return experiment.experiment_id


def run_name(model: str, strategy: str, world_size: int, data_sha256: str, started_at: float) -> str:
    """`mlp-ddp2-data1c6f78c9-20261201-103512`: the model, the strategy and workers, the data
    version and when the execution started, so runs are told apart in the UI's lists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started_at))
    return f"{model}-{strategy}{world_size}-data{data_sha256[:8]}-{stamp}"


MAX_PARAM_CHARS = 6000  # MLflow 3's limit on a param value


class MlflowUnavailable(FlyteRecoverableException):
    """MLflow failed in a way a retry may fix; nothing was promoted."""


class MlflowRefused(PermissionError):
    """The tracking server refused these credentials (or their absence): no retry helps."""


def refusal(exc: Exception) -> str:
    """What to do about an MLflow error that is an authentication server's refusal, in one line
    with no password in it; "" for any other error."""
    code = getattr(exc, "error_code", "")
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    at = shown(tracking_uri())
    if code == "UNAUTHENTICATED":
        given = f"user {user!r} with the password given was not accepted" if user else "none was given"
        return (
            f"the server at {at} needs an MLflow user, and {given}. Export MLFLOW_TRACKING_USERNAME and "
            f"MLFLOW_TRACKING_PASSWORD (on a cluster: the Kubernetes Secret '{SECRET_GROUP}', docs/registry.md)"
        )
    if code == "PERMISSION_DENIED":
        return (
            f"MLflow user {user!r} may not do this at {at}. An MLflow admin grants EDIT on the registered "
            f"model to the users who may register and promote (docs/registry.md)"
        )
    return ""


@contextlib.contextmanager
def mlflow_errors(what: str) -> Iterator[None]:
    """MLflow failures as a retryable error that says what was being done and what did not happen."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        refused = refusal(exc)
        if refused:  # no retry gets in: say so once, as the error a person acts on
            raise MlflowRefused(f"MLflow refused {what}: {refused}. Nothing was promoted.") from None
        raise MlflowUnavailable(
            f"MLflow failed while {what} (after its bounded retries): {exc}. The champion alias was "
            f"not moved; the run can be retried."
        ) from exc
