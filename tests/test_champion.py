"""The champion read fails closed, the alias moves by compare-and-set, and a failed registration
leaves the registry as it was. Against a real MLflow server, faults injected by a proxy."""

from __future__ import annotations

import dataclasses
import tempfile
import time
import uuid

import mlflow
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from flyscale.config import MlflowConfig
from flyscale.data import field_profile, table_examples
from flyscale.data.reference import reference_json
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.gating import ChampionRef
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.evaluate.quantize import quantize
from flyscale.plugin.contracts import GateVerdict
from flyscale.tracking import champion, log_and_register, model_log, promotion, run_log
from flyscale.tracking import store as mlflow_store
from flyscale.tracking.champion import read_baseline
from flyscale.tracking.champion_reference import read_reference, remeasure
from flyscale.tracking.store import MlflowUnavailable
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import TrainHistory
from tests.faults import FaultProxy, fail_all, once


def profile(frame: pd.DataFrame, info) -> field_profile.Profile:
    """A table's profile, as its preparation counts it (a field per column)."""
    view = table_examples.fields_of(info)
    profiler = field_profile.Profiler(view)
    profiler.add({f.name: frame[f.name].to_numpy().astype(f.dtype) for f in view.fields})
    return profiler.profile()


pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def name() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def server(mlflow_server, monkeypatch) -> MlflowClient:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return MlflowClient(mlflow_server)


@pytest.fixture
def proxy(mlflow_server, monkeypatch):
    p = FaultProxy(mlflow_server)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", p.url)
    yield p
    p.close()


def _cfg(name: str, **kw) -> MlflowConfig:
    return MlflowConfig(experiment="champion-tests", model_name=name, retries=1, retry_backoff_s=1, **kw)


def _version(client: MlflowClient, name: str, accuracy: float, sha: str, judged: str = "") -> str:
    """A registered version whose run logged `test_accuracy`, tagged as flyscale tags its own."""
    mlflow.set_tracking_uri(client.tracking_uri)
    mlflow.set_experiment("champion-tests")
    with mlflow.start_run() as run:
        mlflow.log_metric("test_accuracy", accuracy)
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    tags = {champion.WEIGHTS_TAG: sha, champion.JUDGED_TAG: judged, "flyscale.run_id": run.info.run_id}
    return client.create_model_version(name, f"runs:/{run.info.run_id}/m", run.info.run_id, tags=tags).version


@pytest.mark.slow
def test_no_model_and_no_alias_both_mean_no_champion(server, name):
    assert read_baseline(_cfg(name), "sha").version == ""
    _version(server, name, 0.9, "a")  # a model, but no alias yet
    assert read_baseline(_cfg(name), "sha").version == ""


def test_an_mlflow_error_is_never_read_as_no_champion(proxy, name):
    proxy.rule = fail_all
    start = time.monotonic()
    with pytest.raises(MlflowUnavailable, match="MLflow failed while reading the 'champion'.*can be retried"):
        read_baseline(_cfg(name), "sha")
    assert proxy.failed and time.monotonic() - start < 60  # bounded retries, not MLflow's four minutes


def test_a_refused_connection_is_retryable_too(name, monkeypatch):
    from tests.conftest import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens
    with pytest.raises(MlflowUnavailable):
        read_baseline(_cfg(name), "sha")


def test_a_champion_is_judged_against_what_it_beat_when_it_is_the_candidate(server, name):
    first = _version(server, name, 0.90, "weights-a")
    second = _version(server, name, 0.95, "weights-b", judged=first)
    server.set_registered_model_alias(name, "champion", second)
    other = read_baseline(_cfg(name), "weights-c")
    assert other.version == second and other.metrics["accuracy"] == pytest.approx(0.95)
    # The candidate with weights-b is the champion itself: it is judged against v1, as it was.
    itself = read_baseline(_cfg(name), "weights-b")
    assert itself.version == first and itself.metrics["accuracy"] == pytest.approx(0.90)


def test_the_alias_moves_only_if_it_still_points_at_the_judged_champion(server, name):
    v1 = _version(server, name, 0.90, "a")
    v2 = _version(server, name, 0.91, "b")
    judged = ChampionRef(name, "champion")  # judged when there was no champion
    moved = promotion.promote(server, [(name, v1)], "champion", judged, "a", 10, 600)
    assert moved.moved and server.get_model_version_by_alias(name, "champion").version == v1
    # A second candidate judged against "no champion" too: the alias moved meanwhile, so it is refused.
    refused = promotion.promote(server, [(name, v2)], "champion", judged, "b", 10, 600)
    assert not refused.moved and f"moved from no champion to v{v1}" in refused.reason
    assert server.get_model_version_by_alias(name, "champion").version == v1
    # Judged against v1, it moves.
    assert promotion.promote(server, [(name, v2)], "champion", ChampionRef(name, "champion", v1), "b", 10, 600).moved


@pytest.mark.slow
def test_a_champion_without_an_int8_twin_takes_the_old_twins_alias_away(server, name):
    twin = f"{name}-int8"
    v1 = _version(server, name, 0.90, "a")
    run_id = server.get_model_version(name, v1).run_id  # the twin comes from the same run, as publish makes it
    server.create_registered_model(twin)
    t1 = server.create_model_version(twin, f"runs:/{run_id}/q", run_id, tags={"flyscale.run_id": run_id}).version
    assert promotion.promote(
        server, [(name, v1), (twin, t1)], "champion", ChampionRef(name, "champion"), "a", 10, 600
    ).moved
    v2 = _version(server, name, 0.95, "b")  # its int8 did not pay: no twin registered
    judged = ChampionRef(name, "champion", v1)
    assert promotion.promote(server, [(name, v2)], "champion", judged, "b", 10, 600, withdrawn=(twin,)).moved
    assert server.get_model_version_by_alias(name, "champion").version == v2
    assert "champion" not in server.get_registered_model(twin).aliases  # no stale twin serves beside v2
    # A person's rollback to v1 brings its twin back; forward again to v2 takes it off.
    promotion.move_alias(server, name, "champion", v1, "rollback", "oncall", "v2 misbehaves")
    assert server.get_model_version_by_alias(twin, "champion").version == t1
    note = promotion.move_alias(server, name, "champion", v2, "promote", "oncall", "fixed upstream")
    assert "taken off" in note and "champion" not in server.get_registered_model(twin).aliases


def test_the_promotion_lock_waits_then_says_what_to_do(server, name):
    v1 = _version(server, name, 0.9, "a")
    server.create_registered_model(name + promotion.LOCK_SUFFIX, tags={"flyscale.acquired_at": str(time.time())})
    with pytest.raises(MlflowUnavailable, match=r"another run holds .*promotion-lock.*delete that registered model"):
        promotion.promote(server, [(name, v1)], "champion", ChampionRef(name, "champion"), "a", 1.0, 600)
    assert not server.get_registered_model(name).aliases  # nothing moved while it waited
    # A lock left by a dead run (older than lock_stale_s) is broken, and the promotion goes on.
    assert promotion.promote(server, [(name, v1)], "champion", ChampionRef(name, "champion"), "a", 5.0, 0.5).moved
    assert not server.search_registered_models(f"name='{name}{promotion.LOCK_SUFFIX}'")


class Client:
    """The real MlflowClient, with a hook before a chosen call (a fault put in front of the real thing)."""

    def __init__(self, client: MlflowClient, on=None):
        self._client, self._on, self.deleted, self.created = client, on, [], []

    def __getattr__(self, attr):
        return getattr(self._client, attr)

    def get_registered_model(self, name):
        if self._on is not None:
            self._on(name)
        return self._client.get_registered_model(name)

    def create_registered_model(self, name, tags=None, **kw):
        out = self._client.create_registered_model(name, tags=tags, **kw)
        self.created.append((name, (tags or {}).get(promotion.TOKEN_TAG)))
        return out

    def delete_registered_model(self, name):
        # Whose lock this delete removes: the token it holds at that moment.
        self.deleted.append((name, self._client.get_registered_model(name).tags.get(promotion.TOKEN_TAG)))
        return self._client.delete_registered_model(name)


def _take_lock(client: MlflowClient, name: str, token: str, age_s: float = 0.0) -> None:
    client.create_registered_model(
        name + promotion.LOCK_SUFFIX,
        tags={promotion.TOKEN_TAG: token, "flyscale.acquired_at": str(time.time() - age_s)},
    )


def test_a_holder_whose_lock_was_broken_neither_moves_the_alias_nor_deletes_the_new_lock(server, name):
    v1 = _version(server, name, 0.9, "a")
    lock = name + promotion.LOCK_SUFFIX

    def broken_meanwhile(asked: str) -> None:
        # Inside the compare-and-set (reading the alias): another run breaks the lock as stale and takes it.
        if asked == name and server.get_registered_model(lock).tags.get(promotion.TOKEN_TAG) != "theirs":
            server.delete_registered_model(lock)
            _take_lock(server, name, "theirs")

    client = Client(server, on=broken_meanwhile)
    out = promotion.promote(client, [(name, v1)], "champion", ChampionRef(name, "champion"), "a", 5.0, 600)
    assert not out.moved and "another run broke it" in out.reason, out.reason
    assert not server.get_registered_model(name).aliases  # nothing moved without the lock
    assert server.get_registered_model(lock).tags[promotion.TOKEN_TAG] == "theirs"  # left to its holder
    assert client.deleted == []


def test_two_runs_racing_past_a_stale_lock_move_the_alias_once_deleting_only_what_they_may(server, name):
    """A third run died holding the lock: one racer breaks it (once), one moves the alias, the
    other is refused on its stale verdict; each delete removes its own lock or the stale one."""
    from concurrent.futures import ThreadPoolExecutor

    versions = [_version(server, name, 0.9 + i / 100, f"w{i}") for i in range(2)]
    _take_lock(server, name, "dead-run", age_s=3600)
    clients = [Client(server) for _ in versions]
    judged = ChampionRef(name, "champion")  # both judged when there was no champion
    with ThreadPoolExecutor(2) as pool:
        outs = list(
            pool.map(
                lambda i: promotion.promote(clients[i], [(name, versions[i])], "champion", judged, f"w{i}", 30, 1.0),
                range(2),
            )
        )
    assert sum(o.moved for o in outs) == 1, [o.reason for o in outs]
    winner = versions[[o.moved for o in outs].index(True)]
    assert server.get_model_version_by_alias(name, "champion").version == winner
    lock = name + promotion.LOCK_SUFFIX
    deletes = [t for c in clients for n, t in c.deleted if n == lock]
    assert deletes.count("dead-run") == 1  # the stale lock broken once
    for c in clients:  # and every other delete of the lock removed the deleter's own
        own = {t for n, t in c.created if n == lock}
        assert {t for n, t in c.deleted if n == lock} - {"dead-run"} <= own
    assert not server.search_registered_models(f"name LIKE '{lock}%'")  # no lock and no claim left behind


def _record(judged: ChampionRef) -> run_log.RunRecord:
    metrics = EvalMetrics(accuracy=0.9, macro_f1=0.9, loss=0.3, n=10, confusion=[[5, 0], [1, 4]], size_bytes=100)
    return run_log.RunRecord(
        params={"p": 1},
        history=TrainHistory(strategy="ddp", world_size=1),
        fp32=metrics,
        int8=metrics,
        verdicts=[GateVerdict("g", True, "ok")],
        preflight=PreflightReport.skipped(),
        quarantine_dir=tempfile.mkdtemp(),
        validation=ValidationReport(10, 10, 0),
        tags={},
        judged_against=judged,
        weights_sha256="w",
    )


def _files(tmp_path, seed: int = 0) -> tuple[model_log.ModelFiles, model_log.ModelFiles]:
    """A real (small) flyscale model and its int8 twin, as the register task hands them over."""
    from flyscale import model as artifacts
    from flyscale.config import ModelConfig, QuantizeConfig
    from flyscale.plugin.contracts import DatasetInfo
    from flyscale.tracking.model_spec import spec_json

    info = DatasetInfo("t", 2, [4], ["a", "b", "c", "d"])
    cfg = ModelConfig(options={"hidden": [8]})
    torch.manual_seed(seed)
    model = artifacts.build_model(cfg, info)
    int8 = quantize(model, QuantizeConfig(name="torch_dynamic_int8"))
    return (
        model_log.ModelFiles(artifacts.save_state(model, "m.pt"), spec_json(cfg, info, None)),
        model_log.ModelFiles(
            artifacts.save_state(int8, "q.pt"), spec_json(cfg, info, QuantizeConfig(name="torch_dynamic_int8"))
        ),
    )


def test_a_registration_that_fails_half_way_leaves_the_registry_as_it_was(proxy, name, tmp_path):
    def int8_version(method: str, path: str, body: bytes) -> bool:
        return path.endswith("/model-versions/create") and f'"{name}-int8"'.encode() in body

    proxy.rule = int8_version
    fp32, int8 = _files(tmp_path)
    with pytest.raises(MlflowUnavailable, match="MLflow failed while registering"):
        log_and_register.publish(_record(ChampionRef(name, "champion")), fp32, int8, _cfg(name), "r", register=True)
    assert proxy.failed  # the fault was hit: the fp32 version existed when it struck
    client = MlflowClient(proxy.upstream)
    assert client.search_model_versions(f"name='{name}'") == []  # removed again
    assert not client.get_registered_model(name).aliases


def test_a_dataset_another_run_logged_at_the_same_moment_is_logged_again(proxy, name):
    """Two runs on the same data race in the tracking server (both find the dataset missing,
    both insert it); the one that loses gets the server's unique-key 400, and logs it again."""
    proxy.rule = once(lambda method, path, body: path.endswith("/runs/log-inputs"))
    proxy.answer = (
        400,
        {
            "error_code": "BAD_REQUEST",
            "message": "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
            "datasets.name, datasets.digest",
        },
    )
    split = run_log.LoggedDataset("digits", "03d55907d291-train", "", "training", {"features": ("float32", [64])})
    mlflow.set_tracking_uri(proxy.url)  # an earlier test of this process may have set another
    mlflow.set_experiment("champion-tests")
    with mlflow.start_run() as run:
        run_log.log_datasets([split])
    assert proxy.failed == ["POST /api/2.0/mlflow/runs/log-inputs"]  # the fault was hit
    logged = MlflowClient(proxy.upstream).get_run(run.info.run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in logged] == [("digits", "03d55907d291-train")]


def test_registering_the_same_weights_twice_yields_one_version(server, name, tmp_path):
    fp32, int8 = _files(tmp_path)
    record = _record(ChampionRef(name, "champion"))
    record.weights_sha256, record.data_sha256 = "same-weights", "same-data"
    first = log_and_register.publish(record, fp32, int8, _cfg(name), "first", register=True)
    again = log_and_register.publish(record, fp32, int8, _cfg(name), "again", register=True)
    assert (first.model_version, again.model_version) == ("1", "1") and again.reused and not first.reused
    assert [v.version for v in server.search_model_versions(f"name='{name}'")] == ["1"]
    assert [v.version for v in server.search_model_versions(f"name='{name}-int8'")] == ["1"]
    assert server.get_model_version_by_alias(name, "champion").version == "1"


@pytest.mark.parametrize("store", ["server", "sqlite"])
@pytest.mark.slow
def test_a_registered_versions_reference_is_read_back_from_where_its_tag_says(
    store, mlflow_server, name, tmp_path, monkeypatch
):
    from flyscale.plugin.contracts import DatasetInfo

    uri = mlflow_server if store == "server" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    info = DatasetInfo("t", 2, [2], ["a", "b"], feature_dtypes={"a": "double", "b": "double"}, inferred=["features"])
    frame = pd.DataFrame({"a": [0.1, 0.5, 0.9], "b": [1.0, 2.0, 3.0], "label": [0, 1, 0]})
    fp32, int8 = _files(tmp_path)
    record = _record(ChampionRef(name, "champion"))
    record.data_sha256, record.reference_json = "data-a", reference_json(info, profile(frame, info))
    out = log_and_register.publish(record, fp32, int8, _cfg(name), "r", register=True)
    version = MlflowClient(uri).get_model_version(name, out.model_version)
    assert version.tags[mlflow_store.REFERENCE_URI_TAG].endswith("/data/reference.json")
    read = read_reference(_cfg(name), "", "data-b")
    assert read.source == f"v{out.model_version}" and read.profile.rows == 3 and read.schema.features == ["a", "b"]


@pytest.mark.slow
def test_a_model_of_another_kind_is_not_registered_under_the_name(server, name, tmp_path):
    """Checked before training (tests/test_model_kind.py), and again when registering: another
    kind may have been registered meanwhile. The kind is tagged on every version."""
    from flyscale.plugin.contracts import DatasetInfo
    from flyscale.tracking.kind import KIND_TAG, ModelKind

    fp32, int8 = _files(tmp_path)
    record = _record(ChampionRef(name, "champion"))
    record.kind = ModelKind.of(DatasetInfo("t", 2, [4], ["a", "b", "c", "d"]), "classification").to_json()
    first = log_and_register.publish(record, fp32, int8, _cfg(name), "first", register=True)
    assert server.get_model_version(name, first.model_version).tags[KIND_TAG] == record.kind
    record.weights_sha256, record.kind = (
        "other",
        ModelKind.of(DatasetInfo("t", 2, [5], list("abcde")), "classification").to_json(),
    )
    other = log_and_register.publish(record, fp32, int8, _cfg(name), "other", register=True)
    assert other.model_version == "" and not other.champion
    assert other.promotion.startswith(f"not registered: mlflow.model_name {name!r} holds another kind of model")
    assert "mlflow.replace_kind: true" in other.promotion
    record.judged_against = ChampionRef(name, "champion", "1")  # the gates judged it against v1
    replaced = log_and_register.publish(record, fp32, int8, _cfg(name, replace_kind=True), "replaced", register=True)
    assert replaced.model_version == "2" and replaced.champion


def test_manual_promotion_sets_the_challenger_and_leaves_the_champion(server, name, tmp_path):
    fp32, int8 = _files(tmp_path)
    record = _record(ChampionRef(name, "champion"))
    out = log_and_register.publish(record, fp32, int8, _cfg(name, promotion="manual"), "r", register=True)
    assert not out.champion and "'challenger' -> v1" in out.promotion
    assert server.get_model_version_by_alias(name, "challenger").version == "1"
    assert "champion" not in server.get_registered_model(name).aliases
    note = promotion.move_alias(server, name, "champion", "1", "promote", "reviewer", "looked at the curves")
    assert server.get_model_version_by_alias(f"{name}-int8", "champion").version == "1"
    assert "promote by reviewer" in note and "looked at the curves" in note


@pytest.mark.parametrize("tagged", [True, False], ids=["reference-uri-tag", "registered-before-the-tag"])
def test_the_data_reference_is_the_champions_unless_the_champion_was_trained_on_this_data(server, name, tagged):
    from flyscale.plugin.contracts import DatasetInfo

    info = DatasetInfo("t", 2, [2], ["a", "b"], feature_dtypes={"a": "double", "b": "double"}, inferred=["features"])
    frame = pd.DataFrame({"a": [0.1, 0.5, 0.9, 0.3], "b": [1.0, 2.0, 3.0, 4.0], "label": [0, 1, 0, 1]})
    mlflow.set_tracking_uri(server.tracking_uri)
    mlflow.set_experiment("champion-tests")
    with mlflow.start_run() as run:
        mlflow.log_text(reference_json(info, profile(frame, info)), "data/reference.json")
    # Where the tag points, the reference is read from, not from the version's run: a 6-row one here.
    with mlflow.start_run() as elsewhere:
        # ...counted on other bins: its columns declared ranges then, so their histograms have other edges.
        ranged = dataclasses.replace(info, feature_ranges={"a": [0.0, 1.0], "b": [0.0, 5.0]})
        mlflow.log_text(reference_json(info, profile(pd.concat([frame, frame[:2]]), ranged)), "data/reference.json")
    uri_tag = {mlflow_store.REFERENCE_URI_TAG: f"{elsewhere.info.artifact_uri}/data/reference.json"} if tagged else {}
    server.create_registered_model(name)
    version = server.create_model_version(
        name,
        f"runs:/{run.info.run_id}/m",
        run.info.run_id,
        tags={
            "flyscale.run_id": run.info.run_id,
            mlflow_store.DATA_TAG: "data-a",
            mlflow_store.REFERENCE_TAG: "",
            **uri_tag,
        },
    ).version
    assert read_reference(_cfg(name), "", "data-b").source == ""  # no champion yet
    server.set_registered_model_alias(name, "champion", version)
    other = read_reference(_cfg(name), "", "data-b")  # new data: held to the champion's
    assert other.source == f"v{version}" and other.schema.features == ["a", "b"]
    assert other.profile.rows == (6 if tagged else 4)
    # The champion's own data: held to what the champion itself met (here nothing), so a rerun replays.
    assert read_reference(_cfg(name), "", "data-a").source == ""
    # ...but a candidate of other weights is judged against the champion itself: drift is then
    # measured against it, bin for bin from the profiles (the validation, maybe cached, said none).
    judged = ChampionRef(name, "champion", version)
    again = remeasure(_cfg(name), judged, "", profile(frame, info))
    assert again is not None and again.reference == f"v{version}"
    assert "the champion the gate judged against (validation held the data to no reference)" in again.note
    if tagged:  # the champion's data (6 rows) was counted on other bins: those are named, not guessed
        assert again.drift == {"label": 0.0} and "2 histogram(s) on other bins" in again.note  # the same label shares
    else:  # the champion's own data: nothing moved
        assert again.drift == {"a": 0.0, "b": 0.0, "label": 0.0}
    assert remeasure(_cfg(name), judged, f"v{version}", profile(frame, info)) is None  # they agree
    assert remeasure(_cfg(name), judged, "/refs/mine.json", profile(frame, info)) is None  # a file: the user's
    none = remeasure(_cfg(name), ChampionRef(name, "champion"), f"v{version}", profile(frame, info))
    assert none is not None and none.reference == "" and none.drift == {} and "no champion" in none.note


def test_reading_the_reference_fails_closed(proxy, name):
    proxy.rule = fail_all
    with pytest.raises(MlflowUnavailable, match="reading the data reference"):
        read_reference(_cfg(name), "", "sha")
