"""One run logged per pipeline execution, with both models; when every gate passed, their versions
registered (once per weights) and the alias moved.

Only the gate and register tasks call this module, each in one process, so "only rank 0 talks
to MLflow" holds by construction. Registration leaves the registry as it was or complete: the
run and both models are logged first, the versions are registered next, and the alias moves
last, by compare-and-set (flyscale/tracking/promotion.py). If MLflow fails on the way, what this run
registered is deleted again and the run fails with a retryable error.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass

from flyscale.config import MlflowConfig
from flyscale.tracking import champion
from flyscale.tracking import kind as kinds
from flyscale.tracking.champion_reference import _version_of
from flyscale.tracking.descriptions import Describer
from flyscale.tracking.model_log import ModelFiles, link_metrics, log_model
from flyscale.tracking.promotion import Promotion, promote
from flyscale.tracking.run_log import RunRecord, continued_run, log_metrics, log_run
from flyscale.tracking.store import (
    DATA_TAG,
    REFERENCE_TAG,
    REFERENCE_URI_TAG,
    client_settings,
    mlflow_errors,
    shown,
    tracking_uri,
    use_experiment,
)

log = logging.getLogger(__name__)


@dataclass
class Registration:
    """Where a run and its models went; printed in the summary."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    model_name: str
    model_version: str  # "" when nothing was registered (a gate failed)
    int8_model_name: str
    int8_model_version: str
    champion: bool  # whether the alias was moved to these versions
    alias: str
    promotion: str = ""  # why it moved, or why not
    judged_against: str = ""  # the champion the verdict was judged against ("" = none)
    run_name: str = ""
    reused: bool = False  # these weights were registered before: the existing versions were kept


REGISTRATION_TAG = (
    "flyscale.registration_key"  # these weights trained on this data: one version, however often registered
)


def _registration_key(record: RunRecord) -> str:
    """The identity of a training run's result: its weights and the data they were trained and
    tested on (the same weights from other data are another run, with another lineage)."""
    return f"{record.weights_sha256}:{record.data_sha256}"


def _registered(client, name: str, key: str):
    """The version of `name` already registered for this key, or None (registration is idempotent)."""
    found = client.search_model_versions(f"name = '{name}' and tags.`{REGISTRATION_TAG}` = '{key}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def publish(
    record: RunRecord,
    fp32: ModelFiles,
    int8: ModelFiles,
    cfg: MlflowConfig,
    name: str,
    register: bool,
    describe: Describer | None = None,
) -> Registration:
    """Log the run and both models; when `register` (every gate passed), register them (once per
    weights) and move the alias by compare-and-set, or set the challenger alias for a person to
    promote. A failed candidate is logged, with its models, and registered as no version.
    `describe` writes the registry page's descriptions of the versions added and their models."""
    with client_settings(cfg), mlflow_errors(f"registering {cfg.model_name!r}"):
        return _publish(record, fp32, int8, cfg, name, register, describe)


def _publish(
    record, fp32: ModelFiles, int8: ModelFiles, cfg: MlflowConfig, name: str, register: bool, describe
) -> Registration:
    """Log the run and its models, register and promote them, under one open MLflow run.

    One function (about 60 statements) on purpose: the run must stay open from the first log to
    the promotion, and every version this run created is undone by the one `except` around all of
    it; split into helpers, each would have to hand back what it created for that undo."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment_id = use_experiment(client, cfg.experiment)
    mlflow.set_experiment(experiment_id=experiment_id)
    passed = all(v.passed for v in record.verdicts)
    twin = f"{cfg.model_name}-int8"
    names = (cfg.model_name, twin) if not record.int8_not_registered else (cfg.model_name,)
    registered: list[tuple[str, str]] = []
    created: list[tuple[str, str]] = []  # only what this run added is undone on failure
    reused = False
    live = continued_run(client, record.history)
    # One run per execution, spanning it: the one training opened, or one that starts when the execution did.
    run_args = (
        {"run_id": live}
        if live
        else {
            "run_id": client.create_run(
                experiment_id, start_time=int(record.started_at * 1000), run_name=name
            ).info.run_id
        }
    )
    with mlflow.start_run(**run_args) as run, tempfile.TemporaryDirectory() as tmp:  # an exception ends it FAILED
        try:
            log_run(record, passed)
            # Log both models before registering either: a failure here leaves no version behind.
            infos = [log_model(fp32, "model", tmp), log_model(int8, "model_int8", tmp)]
            # The run's metrics after its models, linked to them here: see link_metrics.
            at_step_0 = log_metrics(client, run.info.run_id, record, epochs_logged=bool(live))
            link_metrics(client, run.info.run_id, at_step_0, [info.model_id for info in infos])
            # Checked before training too (check_model); again here, as another kind may have been
            # registered under the name since.
            other = (
                kinds.refusal(client, cfg, kinds.ModelKind.from_json(record.kind)) if register and record.kind else ""
            )
            if not register:
                failed = "; ".join(f"{v.name}: {v.reason}" for v in record.verdicts if not v.passed)
                promotion = Promotion(
                    False,
                    f"not registered: a gate failed ({failed})"
                    if failed
                    else "not registered: no gate is configured (gate: []), and only a judged model is published",
                )
            elif other:
                promotion = Promotion(False, f"not registered: {other}")
            else:
                tags = {
                    "flyscale.gates": "passed",
                    "flyscale.run_id": run.info.run_id,
                    champion.WEIGHTS_TAG: record.weights_sha256,
                    champion.JUDGED_TAG: record.judged_against.version,
                    champion.TEST_DATA_TAG: record.test_sha256,
                    DATA_TAG: record.data_sha256,
                    # What validation held the data to: a rerun on these bytes is held to it again.
                    REFERENCE_TAG: _version_of(
                        record.validation.reference if record.validated_against is None else record.validated_against
                    ),
                    **({kinds.KIND_TAG: record.kind} if record.kind else {}),
                    REFERENCE_URI_TAG: f"{run.info.artifact_uri}/data/reference.json",
                    **record.lineage,
                    REGISTRATION_TAG: _registration_key(record),
                    **{f"flyscale.gate.{v.name}": f"passed: {v.reason}" for v in record.verdicts},
                }
                for model_name, info in zip(names, infos):
                    earlier = _registered(client, model_name, _registration_key(record))
                    if earlier is not None:
                        registered.append((model_name, str(earlier.version)))
                        reused = True
                        continue
                    mv = mlflow.register_model(info.model_uri, model_name, tags=tags)
                    registered.append((model_name, str(mv.version)))
                    created.append((model_name, str(mv.version)))
                if cfg.promotion == "manual":
                    for model_name, version in registered:
                        client.set_registered_model_alias(model_name, cfg.challenger_alias, version)
                    promotion = Promotion(
                        False,
                        f"'{cfg.challenger_alias}' -> v{registered[0][1]} "
                        f"(mlflow.promotion is manual: promote it with `flyscale promote`)",
                    )
                else:
                    promotion = promote(
                        client,
                        registered,
                        cfg.alias,
                        record.judged_against,
                        record.weights_sha256,
                        cfg.lock_timeout_s,
                        cfg.lock_stale_s,
                        # No twin of this version: the old champion's must not stand beside it.
                        withdrawn=(twin,) if record.int8_not_registered else (),
                    )
        except BaseException:
            # Before the alias moved (promote puts it back if it fails half-way): the registry
            # stays as it was, with no half-registered run.
            for model_name, version in created:
                with contextlib.suppress(MlflowException):
                    client.delete_model_version(model_name, version)
            raise
        try:  # the registry is complete and consistent now; the reason is a note on it
            mlflow.set_tag("flyscale.promotion", promotion.reason)
            for model_name, version in created:
                client.set_model_version_tag(model_name, version, "flyscale.promotion", promotion.reason)
            if describe is not None:  # what a person reads on the registry page
                for model_name, version in created:
                    client.update_model_version(model_name, version, description=describe.version(model_name, version))
                for model_name in {m for m, _ in registered}:
                    client.update_registered_model(model_name, description=describe.model(model_name))
        except MlflowException as exc:
            log.warning("could not record the promotion reason and the descriptions: %s", exc)
    if not promotion.moved:
        log.warning("%r alias not moved: %s", cfg.alias, promotion.reason)
    versions = dict(registered)
    return Registration(
        tracking_uri=shown(uri),  # recorded and printed: without a password in it
        experiment_id=run.info.experiment_id,
        run_id=run.info.run_id,
        model_name=names[0],
        model_version=versions.get(names[0], ""),
        int8_model_name=twin,
        int8_model_version=versions.get(twin, ""),
        champion=promotion.moved,
        alias=cfg.alias,
        promotion=promotion.reason,
        judged_against=record.judged_against.version,
        run_name=name,
        reused=reused,
    )
