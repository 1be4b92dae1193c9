"""Serving a registered version with real servers on loopback, each in an environment uv builds
of its own requirements: `flyscale loadtest` against `mlflow models serve` and MLServer with
adaptive batching, logged to MLflow; MLServer really batching concurrent requests; a Triton
repository checked against Triton's config protobuf; and docs/serving.md's request of each
objective, run as written against `mlflow models serve`, with what the served models refuse.
(The registry e2e serves a version the pipeline registered; here models are registered
directly, to keep the servers the subject.)"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from flyscale.serving import servers
from flyscale.serving.repository import Batching, mlserver_repository
from tests.conftest import free_port
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


# --- docs/serving.md's requests, objective by objective, against a real scoring server -------------

DOCS = REPO / "docs" / "serving.md"


@pytest.fixture(scope="module")
def objectives(store) -> dict[str, str]:
    """A model of each objective the docs send requests to, registered beside MODEL as the presets'
    are (images-cnn's 3x32x32 RGB classifier, diabetes's regressor, text-gpt's byte-level GPT of
    128-token sequences): {objective: registered name}."""
    from flyscale.api import DatasetInfo, FieldSpec
    from flyscale.config import ModelConfig, ObjectiveConfig
    from flyscale.data.text import ByteTokenizer
    from flyscale_plugins.images import Shapes, ShapesOptions
    from flyscale_plugins.sklearn_data import Diabetes

    tokens = DatasetInfo(
        "text", 0, [128], [], label_column="", input_field="tokens",
        fields=[FieldSpec("tokens", "int32", [128], range=[0, 256])],
    )  # fmt: skip
    _, home = store
    made = {
        "classification": (
            Shapes().info(ShapesOptions(size=32, encoding="png")),
            ModelConfig(name="cnn", options={"channels": [8], "hidden": 16}),
            None,
            "",
        ),
        "regression": (
            Diabetes().info(None),
            ModelConfig(options={"hidden": [8]}),
            ObjectiveConfig(name="regression"),
            "",
        ),
        "language model": (
            tokens,
            ModelConfig(name="gpt", options={"layers": 1, "heads": 2, "width": 32}),
            ObjectiveConfig(name="language_modeling"),
            ByteTokenizer().to_json(),
        ),
    }
    names = {}
    for objective, (info, model_cfg, objective_cfg, tokenizer) in made.items():
        names[objective] = f"{MODEL}-{objective.replace(' ', '-')}"
        register(home, names[objective], info, model_cfg, objective_cfg, tokenizer)
    return names


@contextlib.contextmanager
def _scoring_server(store, name: str, timeout_s: int = 60) -> Iterator[int]:
    """`mlflow models serve -m models:/NAME@champion --env-manager local` on a free loopback port,
    its request timeout `timeout_s` (MLflow's default: 60 s)."""
    uri, home = store
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"] = str(timeout_s)
    cmd = ["mlflow", "models", "serve", "-m", f"models:/{name}@champion", "--env-manager", "local", "-p", str(port)]
    log = home / f"serve-{name}.log"
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"mlflow models serve did not come up: {log.read_text()[-3000:]}") from None
                time.sleep(0.3)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _post(port: int, body: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations", body.encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text)
        except ValueError:  # not the model's answer: the server's own (a 504 past its timeout)
            return e.code, {"message": text}


def _documented_requests() -> dict[str, str]:
    """The bash blocks of docs/serving.md's requests, by the label of their first line
    (`# classification, uint8 pixels: ...` is "classification, uint8 pixels")."""
    blocks = re.findall(r"```bash\n# ([^:\n]+):[^\n]*\n(.*?)```", DOCS.read_text(), re.S)
    return {label: body for label, body in blocks}


def _run_documented(block: str, port: int, cwd: Path) -> dict:
    """A documented block run by bash as written, against the server on `port`: its JSON answer."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.replace("127.0.0.1:5001", f"127.0.0.1:{port}")],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _documented_refusals() -> dict[str, str]:
    """docs/serving.md's table of what is refused: {what was sent: the message it documents}."""
    rows = re.findall(r"^\| (.+?) \| `(.+?)` \|$", DOCS.read_text(), re.M)
    return {sent: message for sent, message in rows if sent != "sent"}


def _says(documented: str, said: str) -> bool:
    """The server said what the docs say (up to a "..." where the docs elide the rest)."""
    return said.startswith(documented.split("...")[0].rstrip(" ,")) if "..." in documented else said == documented


def _one_line_400(status: int, body: dict) -> str:
    """The message of a refusal, once checked to be a 400 in one line that echoes nothing."""
    assert status == 400 and body.get("error_code") == "INVALID_PARAMETER_VALUE", body
    message = body["message"]
    assert "\n" not in message and "Failed to predict" not in message and "stack_trace" not in body, message
    return message


def test_the_documented_requests_of_each_objective_answer_and_bad_ones_get_one_line_400s(store, objectives, tmp_path):
    from flyscale.data.fields import encode_png
    from flyscale_plugins.images import ShapesOptions, generate

    documented, refusals = _documented_requests(), _documented_refusals()
    assert {"classification, uint8 pixels", "classification, a PNG file", "regression", "language model"} <= set(
        documented
    ), sorted(documented)
    images, _ = generate(16, ShapesOptions(size=32, seed=7), chunk=0)  # the dataset's images, uint8 (16, 3, 32, 32)
    (tmp_path / "photo.png").write_bytes(encode_png(images[0]))
    told = {}

    with _scoring_server(store, objectives["classification"]) as port:
        pixels = _run_documented(documented["classification, uint8 pixels"], port, tmp_path)["predictions"]
        png = _run_documented(documented["classification, a PNG file"], port, tmp_path)["predictions"]
        # Raw uint8 pixels answer as the float path (pixels / 255, what training fed the network).
        status, floats = _post(port, json.dumps({"inputs": (images.astype("float32") / 255).tolist()}))
        status_raw, raw = _post(port, json.dumps({"inputs": images.tolist()}))
        assert status == status_raw == 200
        floats, raw = np.asarray(floats["predictions"]), np.asarray(raw["predictions"])
        assert floats.shape == (16, 4) and np.allclose(raw, floats, atol=1e-6)
        assert (raw.argmax(1) == floats.argmax(1)).all()
        assert np.allclose(pixels, floats[:1], atol=1e-6) and np.allclose(png, floats[:1], atol=1e-6)

        nan = images[:1] / 255
        nan[0, 0, 0, 0] = np.nan  # JSON's NaN, as Python's json writes it
        told["NaN"] = _one_line_400(*_post(port, json.dumps({"inputs": nan.tolist()})))
        told["empty"] = _one_line_400(*_post(port, '{"inputs": []}'))
        told["shape"] = _one_line_400(*_post(port, json.dumps({"inputs": images[:1].transpose(0, 2, 3, 1).tolist()})))
        unscaled = np.zeros((1, 3, 32, 32))
        unscaled[0, 0, 0, 0] = 255.0
        told["floats"] = _one_line_400(*_post(port, json.dumps({"inputs": unscaled.tolist()})))
        big = base64.b64encode(encode_png(np.zeros((3, 48, 48), "uint8"))).decode()
        told["size"] = _one_line_400(*_post(port, json.dumps({"inputs": [big]})))

    with _scoring_server(store, objectives["regression"]) as port:
        values = _run_documented(documented["regression"], port, tmp_path)["predictions"]
        assert len(values) == 1 and isinstance(values[0], float)
        for body, message in _REGRESSION_REFUSED.items():
            assert message in _one_line_400(*_post(port, body))

    with _scoring_server(store, objectives["language model"]) as port:
        text = _run_documented(documented["language model"], port, tmp_path)["predictions"]
        assert len(text) == 2 and all(isinstance(t, str) and t for t in text)
        told["number"] = _one_line_400(*_post(port, '{"inputs": [5]}'))
        told["max_new_tokens"] = _one_line_400(*_post(port, '{"inputs": ["a"], "params": {"max_new_tokens": -5}}'))
        told["long"] = _one_line_400(*_post(port, json.dumps({"inputs": ["x" * 10_000]})))

    # The docs' table says what each of these is answered, word for word.
    for sent, key in [
        ('`{"inputs": []}`', "empty"),
        ('`{"inputs": [[NaN, ...]]}` (JSON\'s `NaN`; `Infinity` too)', "NaN"),
        ("a wrong shape, `(1, 32, 32, 3)` to the image model", "shape"),
        ("floats 0-255 to an image model", "floats"),
        ("a 48x48 PNG to a 32x32 model", "size"),
        ('`{"inputs": [5]}` to a language model', "number"),
        ('`"params": {"max_new_tokens": -5}`', "max_new_tokens"),
        ("a prompt of 10,000 characters (the byte-level model)", "long"),
    ]:
        assert sent in refusals, sorted(refusals)
        assert _says(refusals[sent], told[key]), (sent, refusals[sent], told[key])


# --- what one request may ask: the limits the served model holds, over HTTP, on both servers ----

# A language model registered with small limits (the serving section's fields), and a time budget
# far below the request timeout the scoring server is given (LIMITED_TIMEOUT_S).
LIMITS = {"max_prompts": 3, "max_prompt_chars": 40, "max_new_tokens": 100_000, "time_budget_s": 0.5}
LIMITED_TIMEOUT_S = 5
# Sent to the language model: {label: (prompts, params, what the 400 says)}.
PAST_LIMITS = {
    "too many prompts": (["a"] * 4, {}, "4 prompts in one request; this model answers at most 3 a request (serving.max_prompts)"),
    "a prompt too long": (["a", "b" * 41], {}, "prompt 1 is 41 characters; this model reads at most 40 (serving.max_prompt_chars)"),
    "max_new_tokens too large": (["a"], {"max_new_tokens": 100_001}, "from 1 to 100000 (serving.max_new_tokens), got 100001"),
    "past the time budget": (["a"], {"max_new_tokens": 100_000}, "generation ran past this model's time budget of 0.5 s (serving.time_budget_s) after "),
}  # fmt: skip
_ROW = [0.1] * 10  # a row of the regression model's 10 features
_REGRESSION_REFUSED = {
    json.dumps({"inputs": [_ROW] * 1025}): "1,025 examples in one request; this model answers at most 1,024 a request (serving.max_rows)",
    '{"inputs": [[0.1, NaN, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]]}': "NaN (or null) in 1 of 1 examples",
    '{"inputs": [[0.1, Infinity, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]]}': "infinite values in 1 of 1 examples",
}  # fmt: skip


@pytest.fixture(scope="module")
def limited(store) -> str:
    """A byte-level GPT registered with LIMITS; its registered name."""
    from flyscale.api import DatasetInfo, FieldSpec
    from flyscale.config import ModelConfig, ObjectiveConfig
    from flyscale.data.text import ByteTokenizer

    tokens = DatasetInfo(
        "text", 0, [32], [], label_column="", input_field="tokens",
        fields=[FieldSpec("tokens", "int32", [32], range=[0, 256])],
    )  # fmt: skip
    name = f"{MODEL}-limited"
    gpt = ModelConfig(name="gpt", options={"layers": 1, "heads": 2, "width": 32})
    register(store[1], name, tokens, gpt, ObjectiveConfig(name="language_modeling"), ByteTokenizer().to_json(), LIMITS)
    return name


def _server_cpu_s() -> float:
    """CPU seconds used so far by every process this test process started (the servers and theirs)."""
    tick, ppid, used = os.sysconf("SC_CLK_TCK"), {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ppid[int(entry.name)], used[int(entry.name)] = int(stat[1]), (int(stat[11]) + int(stat[12])) / tick
    ours, more = set(), {os.getpid()}
    while more:
        ours |= more
        more = {p for p, parent in ppid.items() if parent in more} - ours
    return sum(used[p] for p in ours - {os.getpid()})


def _answered_and_stopped(ask) -> None:
    """`ask(prompts, params) -> (status, message)`: each request past a limit is a one-line 400
    naming it; the one past the time budget is answered at the budget, the server then idles (no
    generation running on after the answer) and answers the next request at once."""
    for label, (prompts, params, message) in PAST_LIMITS.items():
        started = time.monotonic()
        status, said = ask(prompts, params)
        took = time.monotonic() - started
        assert status == 400 and message in said, (label, status, said)
        assert "\n" not in said and "Traceback" not in said and "Failed to predict" not in said, said
    assert took < LIMITED_TIMEOUT_S - 2, took  # the budget's answer, well before the server's timeout
    time.sleep(0.3)
    before = _server_cpu_s()
    time.sleep(1.5)
    assert _server_cpu_s() - before < 0.5, "the server kept computing after it answered"
    started = time.monotonic()
    status, said = ask(["a"], {"max_new_tokens": 3})
    assert status == 200 and time.monotonic() - started < 1.0, (status, said, time.monotonic() - started)


def test_mlflow_serve_answers_requests_past_the_limits_with_400s_naming_them(store, limited):
    def ask(prompts: list, params: dict) -> tuple[int, str]:
        status, body = _post(port, json.dumps({"inputs": prompts, "params": params}))
        assert "stack_trace" not in body, body
        return status, body["message"] if status != 200 else json.dumps(body)

    with _scoring_server(store, limited, timeout_s=LIMITED_TIMEOUT_S) as port:
        _answered_and_stopped(ask)


def test_mlserver_answers_requests_past_the_limits_with_400s_naming_them(store, objectives, limited, envs, tmp_path):
    """MLServer's V2 endpoint (what flyscale's load test sends): the same limits, refused as 400s
    in one line; the regression model's rows, NaN and infinity too."""
    repo = tmp_path / "repo"
    for name in (limited, objectives["regression"]):
        model_dir = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/1", tracking_uri=store[0]))
        mlserver_repository(model_dir, repo, name, Batching(1, 0))

    def infer(base: str, name: str, tensor: dict, params: dict) -> tuple[int, str]:
        body = json.dumps({"inputs": [{"name": "input", **tensor}], "parameters": params})
        request = urllib.request.Request(
            f"{base}/v2/models/{name}/infer", body.encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            return e.code, json.loads(text)["error"] if text.startswith("{") else text

    with servers.mlserver(repo, envs) as base:
        _answered_and_stopped(
            lambda prompts, params: infer(
                base, limited, {"shape": [len(prompts)], "datatype": "BYTES", "data": prompts}, params
            )
        )
        for body, message in _REGRESSION_REFUSED.items():
            rows = json.loads(body.replace("NaN", '"NaN"').replace("Infinity", '"Infinity"'))["inputs"]
            tensor = {"shape": [len(rows), 10], "datatype": "FP32", "data": [v for row in rows for v in row]}
            status, said = infer(base, objectives["regression"], tensor, {})
            assert status == 400 and message in said and "\n" not in said, (status, said)
