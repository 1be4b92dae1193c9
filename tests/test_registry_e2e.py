"""The registry and the UI through real `pyflyte run` against a real `mlflow server`: checked
through MLflow's client, the first model becomes champion and a better one takes the alias; runs
are told apart by name, training curves are there, rollback moves the alias back and says who and why, and both champions load with pickle deserialization
disabled. Then a headless browser opens the UI where the summary says, lands on the runs, and
compares two."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from flyscale.tracking.store import KIND_TAG, TRAINING_KIND
from tests.conftest import BIN, REPO, free_port, run_pipeline

MODEL = "flyscale-digits"  # the default digits config's name, which the README loads


def _cfg(tmp_path, name: str, epochs: int):
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "augment": {"copies": 0},
                "train": {"epochs": epochs, "batch_size": 64},
                "gate": [{"name": "beats_champion"}, {"name": "quantization"}],  # no options: their defaults
                # The twin's registry pages and aliases are tested here, whatever this machine's timing says.
                "quantize": {"twin": "always"},
                "mlflow": {"experiment": "registry-e2e"},  # no model_name: the digits default's
            }
        )
    )
    return path


def _run(tmp_path, name: str, epochs: int, uri: str) -> str:
    home = tmp_path / f"home-{name}"  # its own Flyte cache: every run trains
    home.mkdir()
    proc = run_pipeline(home, "--cfg", str(_cfg(tmp_path, name, epochs)), env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout


def _run_id(out: str) -> str:
    return re.search(r"mlflow\s+run (\w+)", out).group(1)


def _loads_without_pickle(uri: str, models: list[str]) -> subprocess.CompletedProcess:
    code = (
        "import mlflow, numpy as np\n"
        f"for name in {models!r}:\n"
        "    m = mlflow.pyfunc.load_model(f'models:/{name}@champion')\n"
        "    p = m.predict(np.zeros((3, 64), dtype='float32'))\n"
        "    assert p.shape == (3, 10) and abs(p.sum(axis=1) - 1).max() < 1e-5, p\n"
        "    print('loaded', name, type(m.unwrap_python_model()).__name__)\n"
    )
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false", "PATH": str(BIN)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _served(uri: str, model_uri: str, rows, envs: Path) -> dict:
    """`mlflow models serve -m MODEL_URI --env-manager uv` on a free port, as the registry page
    says: uv builds a fresh environment (under `envs`) of the model's requirements alone, from
    the package index, so no flyscale and no torch. The answer to one POST of `rows`."""
    import urllib.request

    port = free_port()
    # mlflow and uv on the PATH, as the page assumes.
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_ENV_ROOT": str(envs),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = ["mlflow", "models", "serve", "-m", model_uri, "--env-manager", "uv", "-p", str(port)]
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # the environment is installed first
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"mlflow models serve did not come up: {server.stderr.read()[-3000:]}"
                    ) from None
                time.sleep(0.5)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps({"inputs": rows.tolist()}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def executions(tmp_path_factory, mlflow_server) -> dict[str, str]:
    """Two real executions against one server, shared by the registry and the UI tests: a first
    model, then a better one. {name: the run summary}. (A worse candidate against a champion,
    which takes the other branch and registers no version, is tests/test_promotion_e2e.py's
    re-judging.)"""
    tmp = tmp_path_factory.mktemp("registry-e2e")
    return {name: _run(tmp, name, epochs, mlflow_server) for name, epochs in (("first", 3), ("better", 12))}


@pytest.mark.timeout(1200)
def test_the_registry_compares_publishes_and_rolls_back(executions, mlflow_server, tmp_path):
    uri = mlflow_server
    client = MlflowClient(uri)
    first, better = executions["first"], executions["better"]
    assert "beats_champion: PASSED (no champion yet" in first and "register_model" in first

    assert "beats_champion: PASSED" in better and "'champion' moved from v1 to v2" in better
    # v1 was scored on this run's test split through its registered model: the same split as its
    # own, so the very number it recorded, and the verdict compares that.
    assert "champion v1 was scored on it through its registered model" in better
    assert "the metrics it recorded are from the same split" in better
    recorded = client.get_run(_run_id(first)).data.metrics["test_accuracy"]
    assert client.get_run(_run_id(better)).data.metrics["champion_test_accuracy"] == pytest.approx(recorded, abs=1e-9)
    assert f"vs champion v1 {recorded:.4f}, both on this run's test split: better" in better

    assert sorted(v.version for v in client.search_model_versions(f"name='{MODEL}'")) == ["1", "2"]
    assert client.get_model_version_by_alias(MODEL, "champion").version == "2"
    assert client.get_model_version_by_alias(f"{MODEL}-int8", "champion").version == "2"
    logged = client.search_logged_models(
        experiment_ids=[client.get_run(_run_id(better)).info.experiment_id],
        filter_string=f"source_run_id = '{_run_id(better)}'",
    )
    assert sorted(m.name for m in logged) == ["model", "model_int8"]
    # Each logged model carries the run's metrics (its page and the Models tab show them), though
    # the run logs them after its models (flyscale/tracking/model_log.py link_metrics).
    run_metrics = client.get_run(_run_id(better)).data.metrics
    for model in logged:
        linked = {m.key: m.value for m in model.metrics}
        assert linked.keys() == run_metrics.keys(), (model.name, sorted(run_metrics.keys() - linked.keys()))
        assert linked["test_accuracy"] == run_metrics["test_accuracy"]

    # Lineage on every version.
    v2 = client.get_model_version(MODEL, "2")
    for tag in (
        "flyscale.data_fingerprint",
        "flyscale.config_sha256",
        "flyscale.git_commit",
        "flyscale.flyte_execution",
        "flyscale.image",
        "flyscale.gate.beats_champion",
        "flyscale.gate.quantization",
        "flyscale.test_data_sha256",
    ):
        assert v2.tags.get(tag), f"version 2 has no {tag}: {v2.tags}"

    # The registry page reads as prose: what the version is, its metrics beside the champion it
    # beat (v1), its data, how to load and serve it; and the model says what feeds it.
    page = v2.description
    assert page.startswith(f"**{MODEL} v2**: a `mlp` model with the `classification` objective, trained with `ddp`")
    assert "| test metric | v2 | v1 (on this test split) |" in page and "| accuracy | " in page
    accuracy = client.get_run(_run_id(better)).data.metrics["test_accuracy"]
    assert f"| accuracy | {accuracy:.4f} | " in page
    assert v2.tags["flyscale.data_fingerprint"][:16] in page
    assert f'mlflow models serve -m "models:/{MODEL}/2" --env-manager uv' in page
    assert "it needs only mlflow, onnxruntime and numpy" in page
    assert "beats_champion passed" in page and "ONNX: artifact `onnx/model.onnx`" in page
    int8_page = client.get_model_version(f"{MODEL}-int8", "2").description
    assert int8_page.startswith(f"**{MODEL}-int8 v2**: the int8 twin (dynamic_int8) of a `mlp` model")
    about = client.get_registered_model(MODEL).description
    assert "Trained by flyscale's `training_pipeline`" in about and "`beats_champion`, `quantization`" in about

    # The UI opens on runs, runs have names that tell them apart, curves and the config are there.
    runs = [client.get_run(_run_id(out)) for out in (first, better)]
    experiment = client.get_experiment(runs[0].info.experiment_id)
    assert experiment.tags[KIND_TAG] == TRAINING_KIND
    names = [r.info.run_name for r in runs]
    assert len(set(names)) == 2 and all(n.startswith("mlp-ddp2-data") for n in names), names
    for r, epochs in zip(runs, (3, 12)):
        assert r.data.tags.get("flyscale.live") == "training"  # curves logged by training as it ran
        assert len(client.get_metric_history(r.info.run_id, "val_loss")) == epochs
        assert r.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(runs[1].info.run_id)}
    assert "config.yaml" in artifacts, artifacts
    assert "gate.gates.0.name" in runs[1].data.params

    # The ONNX export beside it, checked against PyTorch on the whole test split, named by its sha256
    # on the version, and answering as the registered model does, with onnxruntime alone.
    assert "  onnx        ONNX Runtime against PyTorch on " in better and "the same prediction on every one" in better
    onnx_file = Path(client.download_artifacts(runs[1].info.run_id, "onnx/model.onnx", str(tmp_path / "onnx")))
    assert hashlib.sha256(onnx_file.read_bytes()).hexdigest() == v2.tags["flyscale.onnx_sha256"]
    import numpy as np
    import onnxruntime as ort

    rows = np.random.default_rng(0).uniform(0, 16, (5, 64)).astype("float32")
    logits = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"]).run(None, {"input": rows})[0]
    # The command the page prints serves the version over HTTP on loopback; the ONNX file answers the same.
    served = np.asarray(_served(uri, f"models:/{MODEL}/2", rows, tmp_path / "envs")["predictions"])
    environment = next((tmp_path / "envs").iterdir())  # what uv built: the requirements, nothing of ours
    installed = {p.name.split("-")[0].lower() for p in environment.glob("**/site-packages/*.dist-info")}
    assert {"mlflow", "onnxruntime", "numpy"} <= installed and not installed & {"torch", "flyscale"}, installed
    assert served.shape == (5, 10) and abs(served.sum(axis=1) - 1).max() < 1e-5
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probabilities / probabilities.sum(1, keepdims=True), served, atol=1e-5)

    # Both champions load with pickle deserialization disabled.
    loaded = _loads_without_pickle(uri, [MODEL, f"{MODEL}-int8"])
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.count("OnnxModel") == 2, loaded.stdout  # both served from ONNX: int8 too

    # The first run's own config.yaml, run again on new data (another split of the digits, a fresh
    # cache): judged against champion v2 scored on this run's test split, which is not v2's own,
    # and not better, so nothing is registered and the alias stays. Going back is what rollback is for.
    old = Path(client.download_artifacts(runs[0].info.run_id, "config.yaml", str(tmp_path)))
    home = tmp_path / "home"
    home.mkdir()
    replay = run_pipeline(home, "--cfg", str(old), "--cfg", '{"data": {"seed": 1}}', env={"MLFLOW_TRACKING_URI": uri})
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-4000:]
    assert "beats_champion: FAILED" in replay.stdout and "vs champion v2" in replay.stdout, replay.stdout[-3000:]
    rejudged = client.get_run(_run_id(replay.stdout))
    scored = rejudged.data.metrics["champion_test_accuracy"]  # v2 on this split, beside this run's test_accuracy
    assert f"vs champion v2 {scored:.4f}, both on this run's test split" in replay.stdout
    split = re.search(r"test data   this run's test split \((\w+)\): champion v2 was scored on it", replay.stdout)
    own = re.search(r"the metrics it recorded are from its own test split \((\w+)\)", replay.stdout)
    assert split and own and split.group(1) != own.group(1), replay.stdout[-3000:]
    assert rejudged.data.tags["flyscale.test_data"].startswith(f"this run's test split ({split.group(1)})")
    assert client.get_model_version_by_alias(MODEL, "champion").version == "2"
    assert sorted(v.version for v in client.search_model_versions(f"name='{MODEL}'")) == ["1", "2"]

    # Rollback moves both aliases back and records who and why.
    proc = subprocess.run(
        [
            str(BIN / "flyscale"),
            "rollback",
            "--model",
            MODEL,
            "--to",
            "1",
            "--reason",
            "v2 misbehaves in prod",
            "--who",
            "oncall",
        ],
        env={"MLFLOW_TRACKING_URI": uri, "PATH": str(BIN)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert client.get_model_version_by_alias(MODEL, "champion").version == "1"
    assert client.get_model_version_by_alias(f"{MODEL}-int8", "champion").version == "1"
    note = client.get_model_version(MODEL, "1").tags["flyscale.rollback"]
    assert "rollback by oncall" in note and "from v2 to v1" in note and "v2 misbehaves in prod" in note
    refused = subprocess.run(
        [str(BIN / "flyscale"), "rollback", "--model", MODEL, "--to", "9", "--reason", "x"],
        env={"MLFLOW_TRACKING_URI": uri, "PATH": str(BIN)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and f"{MODEL!r} has no version '9'; its versions: 1, 2" in refused.stderr
    assert f"tracking store: {uri}" in refused.stderr  # it says where it looked
    misspelt = subprocess.run(
        [str(BIN / "flyscale"), "rollback", "--model", MODEL[:-1], "--to", "1", "--reason", "x"],
        env={"MLFLOW_TRACKING_URI": uri, "PATH": str(BIN)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert misspelt.returncode == 2, misspelt.stderr
    assert f"there is no registered model {MODEL[:-1]!r}; did you mean {MODEL!r}?" in misspelt.stderr


CHROMIUM = Path("/usr/bin/chromium")
# Without these chromium stalls or fails on a closed network (no sandbox as root, no GPU, no calls home).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# MLflow 3.17's UI picks the experiment page's landing view from the browser's "GenAI" /
# "Model training" switch (the URL's workflowType, else localStorage, else GenAI), not from the
# experiment's kind tag: a fresh browser on `#/experiments/<id>` lands on the GenAI overview
# whatever the tag says. `workflowType=machine_learning` is the switch set to "Model training".
EXPERIMENT_PAGE = "{base}/#/experiments/{experiment_id}?workflowType=machine_learning"
# The UI's own compare link (Routes.getCompareRunPageRoute): JSON arrays of run and experiment ids.
COMPARE_PAGE = "{base}/#/compare-runs?runs={runs}&experiments={experiments}"
UI_TIMEOUT_MS = 60_000  # generous: the server has one worker, and CI machines are shared


@pytest.fixture
def browser_page(tmp_path):
    """A Playwright page in Debian's headless chromium, on a fresh empty profile."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1600, "height": 1000},
        )
        try:
            page = context.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            context.close()


@pytest.mark.timeout(1200)
def test_the_ui_lands_on_the_runs_and_compares_two(executions, tmp_path, mlflow_server, browser_page):
    """In Debian's headless chromium (Playwright; `make test` installs it when missing), as a
    person opens what the summary prints."""
    from playwright.sync_api import expect

    run_ids = [_run_id(executions["first"]), _run_id(executions["better"])]
    url = re.search(r"mlflow ui\s+open (\S+)", executions["better"]).group(1)

    # Names and ids as MLflow has them, not as we think we wrote them.
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("registry-e2e")
    runs = [client.get_run(run_id) for run_id in run_ids]
    assert {r.info.experiment_id for r in runs} == {experiment.experiment_id}
    names = [r.info.run_name for r in runs]

    page = browser_page
    # The address the run summary prints: it must be the one that lands on the runs.
    assert url == EXPERIMENT_PAGE.format(base=mlflow_server, experiment_id=experiment.experiment_id), url
    page.goto(url)
    # The experiment page redirects to a tab: the runs view, or the GenAI overview (traces, tokens).
    page.wait_for_url(re.compile(rf"#/experiments/{experiment.experiment_id}/(runs|overview|traces)\b"))
    runs_table, genai = page.get_by_role("grid"), page.get_by_text("Token Usage")
    expect(runs_table.or_(genai).first).to_be_visible(timeout=UI_TIMEOUT_MS)
    shot = tmp_path / "experiment-page.png"
    page.screenshot(path=str(shot), full_page=True)
    where = f"{url} went to {page.url} (screenshot {shot})"
    assert genai.count() == 0, f"landed on the GenAI overview, not the runs: {where}"
    assert f"/experiments/{experiment.experiment_id}/runs" in page.url, f"not the runs view: {where}"

    assert len(set(names)) == 2, f"the two runs are not told apart by name: {names} ({where})"
    for name in names:
        try:
            expect(runs_table.get_by_text(name, exact=True)).to_be_visible(timeout=UI_TIMEOUT_MS)
        except AssertionError as exc:
            page.screenshot(path=str(shot), full_page=True)
            raise AssertionError(f"run {name!r} is not in the runs table: {where}") from exc

    compact = {"separators": (",", ":")}  # as the UI's JSON.stringify writes them
    url = COMPARE_PAGE.format(
        base=mlflow_server,
        runs=json.dumps(run_ids, **compact),
        experiments=json.dumps([experiment.experiment_id], **compact),
    )
    page.goto(url)
    shot = tmp_path / "compare-runs.png"
    try:
        expect(page.get_by_text("Comparing 2 Runs")).to_be_visible(timeout=UI_TIMEOUT_MS)
        for name, run_id in zip(names, run_ids):
            expect(page.get_by_text(name, exact=True)).to_be_visible()
            expect(page.get_by_text(run_id, exact=True)).to_be_visible()
    except AssertionError as exc:
        page.screenshot(path=str(shot), full_page=True)
        raise AssertionError(f"the compare view does not show both runs {names}: {url} (screenshot {shot})") from exc
    page.screenshot(path=str(shot), full_page=True)


@pytest.mark.timeout(900)
def test_the_docs_own_data_example_never_moves_the_digits_champion(executions, mlflow_server, tmp_path):
    """README's "Bring your own data" (labelled rows in Parquet, an `mlp`), without the model name
    the README now gives it, in the store where the digits quickstart's `flyscale-digits` has its
    champion: it is registered under the name of its own data, and the digits champion stays.
    Named `flyscale-digits` on purpose, it is refused before any data is read, naming both kinds
    and the option that would register it anyway."""
    import numpy as np
    import pandas as pd

    client = MlflowClient(mlflow_server)
    before = client.get_model_version_by_alias(MODEL, "champion").version
    rng = np.random.default_rng(0)
    rows = 400
    target = rng.integers(0, 2, rows)
    frame = pd.DataFrame(
        {
            "customer_id": np.arange(rows),
            "age": rng.integers(18, 90, rows).astype("float64"),
            "income": np.where(target == 1, rng.normal(80, 3, rows), rng.normal(20, 3, rows)),  # the gates pass
            "tenure": rng.integers(0, 30, rows).astype("float64"),
            "target": target,
        }
    )
    (tmp_path / "data").mkdir()
    frame.to_parquet(tmp_path / "data" / "part-0.parquet", index=False)
    options = {
        "path": str(tmp_path / "data"),
        "label": "target",
        "ignore": ["customer_id"],
        "ranges": {"age": [0, 130]},
    }
    mine = {"data": {"dataset": "parquet", "options": options}, "model": {"name": "mlp"}}
    env = {"MLFLOW_TRACKING_URI": mlflow_server}

    for home in ("home", "named"):
        (tmp_path / home).mkdir()
    done = run_pipeline(tmp_path / "home", "--cfg", json.dumps(mine), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    assert "registered  flyscale-parquet v1" in done.stdout and "'champion' moved from no champion to v1" in done.stdout
    assert client.get_model_version_by_alias(MODEL, "champion").version == before
    assert client.get_model_version_by_alias("flyscale-parquet", "champion").tags["flyscale.kind"] == json.dumps(
        {
            "columns": ["age", "income", "tenure"],
            "columns_sha256": hashlib.sha256(b"age\nincome\ntenure").hexdigest(),
            "dtype": "float32",
            "objective": "classification",
            "shape": [3],
            "text": False,
        },
        sort_keys=True,
    )

    named = run_pipeline(tmp_path / "named", "--cfg", json.dumps({**mine, "mlflow": {"model_name": MODEL}}), env=env)
    log = named.stdout + named.stderr
    assert named.returncode != 0
    assert f"mlflow.model_name '{MODEL}' holds another kind of model: its 'champion' v{before} takes 64 float " in log
    assert "this run's model would take 3 float features (age, income, tenure; classification)" in log, log[-3000:]
    assert "(mlflow.model_name: flyscale-parquet)" in log and "mlflow.replace_kind: true" in log
    assert "fingerprint_data" not in log  # refused before any data was read
    assert client.get_model_version_by_alias(MODEL, "champion").version == before
