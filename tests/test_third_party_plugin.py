"""Third-party plugin packages, never mentioned in flyscale's code, used by name.

tests/example_plugin (imports nothing from flyscale, returns its own objects) and
tests/example_typed_plugin (written against `flyscale.api`) are built and installed with pip
into a scratch directory put on PYTHONPATH (the venv itself is left untouched: other tests list
what is installed); entry-point discovery is the same as for a package installed into the venv.
Everything then runs in subprocesses, exactly as a user would: `flyscale plugins`, config
validation, and the whole pipeline under `pyflyte run`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import fresh_python, run_pipeline

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = [REPO / "tests" / "example_plugin", REPO / "tests" / "example_typed_plugin"]
DIST = "acme-flyscale-example 0.3.1"
TYPED = "acme-flyscale-typed 1.0.0"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example packages pip-installed into a scratch site directory (no network needed)."""
    root = tmp_path_factory.mktemp("thirdparty")
    # Build from copies: setuptools writes build/ and *.egg-info next to the sources.
    srcs = [
        shutil.copytree(example, root / example.name, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        for example in EXAMPLES
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(root / "site"),
            *map(str, srcs),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root / "site"


def _env(site: Path) -> dict[str, str]:
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(site) + (os.pathsep + old if old else "")}


def _python(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(site), capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_flyscale_plugins_shows_third_party_and_broken_plugins(site):
    proc = _python(site, "-m", "flyscale.cli", "plugins")
    assert proc.returncode == 0, proc.stderr  # a broken plugin is reported, not fatal
    rows = {tuple(line.split()[:2]): line for line in proc.stdout.splitlines()}
    for kind, name, value, dist in [
        ("datasets", "acme_wine", "acme_flyscale.datasets:wine", DIST),
        ("models", "acme_tiny_mlp", "acme_flyscale.models:TinyMLP", DIST),  # a class: built once, then checked
        ("gates", "acme_min_f1", "acme_flyscale.gates:min_f1", DIST),
        ("gates", "acme_max_loss", "acme_typed.plugins:max_loss", TYPED),
        ("models", "acme_linear", "acme_typed.plugins:linear", TYPED),
    ]:
        line = rows[(kind, name)]
        assert value in line and dist in line and line.rstrip().endswith("ok"), line
    broken = rows[("models", "acme_broken")]
    assert DIST in broken
    assert "broken: ImportError: acme_flyscale.broken needs the 'acme-cuda-kernels' package" in broken
    # The wrong shape is caught at lookup, with the method it lacks, not later inside a worker.
    wrong = rows[("models", "acme_no_build")]
    assert DIST in wrong and "broken:" in wrong and "has no method build(options, info)" in wrong, wrong
    # The broken ones spoil nothing else.
    assert rows[("models", "mlp")].rstrip().endswith("ok")
    assert rows[("gates", "min_metric")].rstrip().endswith("ok")
    assert f"2 broken: models/acme_broken ({DIST}), models/acme_no_build ({DIST})" in proc.stdout


# Every case's config is built in one fresh process (as `pyflyte run` builds a run's): one
# subprocess for all the cases, not one each (each paid torch's import, 2-3 s).
CHECK_CONFIGS = """
import json, sys
from flyscale.config import DataConfig, GateConfig, ModelConfig
for kind, name, options in json.loads(sys.argv[1]):
    try:
        if kind == "data":
            DataConfig(dataset=name, options=options)
        else:
            (ModelConfig if kind == "model" else GateConfig)(name=name, options=options)
        print(json.dumps(["valid"]))
    except ValueError as exc:
        print(json.dumps(["error", str(exc)]))
"""

CASES = [
    ("model", "acme_tiny_mlp", "{'width': 32}", ["valid"]),
    ("gate", "acme_min_f1", "{'threshold': 0.8}", ["valid"]),
    ("data", "acme_wine", "{}", ["valid"]),
    ("gate", "acme_max_loss", "{'max_loss': 0.3}", ["valid"]),
    ("gate", "acme_max_loss", "{'max_loss': 0}", ["gate.options: max_loss must be > 0, got 0"]),
    # A plugin of the wrong shape is refused when the config is built, naming what it lacks.
    (
        "model",
        "acme_no_build",
        "{}",
        [
            "model.name: model plugin 'acme_no_build' from package 'acme-flyscale-example' "
            "(acme_flyscale.models:NoBuild) does not fit the models contract: it has no method build(options, info)",
        ],
    ),
    # A broken plugin: named, with its package, its error, and what else there is.
    (
        "model",
        "acme_broken",
        "{}",
        [
            "model.name: model plugin 'acme_broken' from package 'acme-flyscale-example'",
            "acme-cuda-kernels",
            "Other models: acme_bn_mlp, acme_gated, acme_linear, acme_no_build, acme_residual, acme_running_max, acme_tiny_mlp, cnn, gpt, huggingface, mlp",
        ],
    ),
    (
        "model",
        "resnet9000",
        "{}",
        [
            "model.name: unknown model 'resnet9000'; available: acme_bn_mlp, acme_broken, acme_gated, acme_linear, "
            "acme_no_build, acme_residual, acme_running_max, acme_tiny_mlp, cnn, gpt, huggingface, mlp",
        ],
    ),
    (
        "gate",
        "f1",
        "{}",
        [
            "gate.name: unknown gate 'f1'; available: acme_max_loss, acme_min_f1, beats_champion, min_metric, "
            "quantization"
        ],
    ),
    # The plugin's own options dataclass validates its section, field by field.
    ("model", "acme_tiny_mlp", "{'width': 0}", ["model.options: width must be > 0, got 0"]),
    (
        "model",
        "acme_tiny_mlp",
        "{'depth': 3}",
        ["model.options.depth: unknown option; did you mean 'width'? expected one of width"],
    ),
    ("gate", "acme_min_f1", "{'threshold': 1.5}", ["gate.options: threshold must be in [0, 1], got 1.5"]),
]


@pytest.fixture(scope="module")
def validated(site) -> list[list[str]]:
    """What building each case's config printed, in CASES order."""
    proc = _python(site, "-c", CHECK_CONFIGS, json.dumps([(k, n, ast.literal_eval(o)) for k, n, o, _ in CASES]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(CASES), proc.stdout + proc.stderr
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{k}-{n}-{o}" for k, n, o, _ in CASES])
@pytest.mark.slow
def test_config_validation_with_third_party_plugins(validated, case):
    expected = CASES[case][3]
    verdict = validated[case]
    if expected == ["valid"]:
        assert verdict == ["valid"]
    else:
        assert verdict[0] == "error", verdict
        for text in expected:
            assert text in verdict[1], verdict[1]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_pipeline_runs_with_plugins_selected_by_name(site, tmp_path, serving_envs):
    """THE end-to-end: a YAML preset picks Acme's tabular dataset, model and gate, none of which
    imports flyscale or returns flyscale's types; pyflyte runs every stage."""
    preset = tmp_path / "acme.yaml"
    preset.write_text(
        yaml.safe_dump(
            {
                "data": {"dataset": "acme_wine"},  # no augment section: the dataset declares no augmentations
                "model": {"name": "acme_tiny_mlp", "options": {"width": 32}},
                "gate": {"name": "acme_min_f1", "options": {"threshold": 0.9}},
                "train": {"epochs": 20, "batch_size": 16},
                "mlflow": {"experiment": "acme", "model_name": "acme-wine"},
            }
        )
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri, "PYTHONPATH": _env(site)["PYTHONPATH"]}
    home = tmp_path / "home"  # isolated flytekit local cache
    home.mkdir()
    proc = run_pipeline(home, "--cfg", str(preset), env=env, timeout=280)
    assert proc.returncode == 0, f"pyflyte run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "flyscale run summary" in proc.stdout, proc.stdout[-3000:]
    assert "178 rows: 178 valid, 0 quarantined" in proc.stdout  # checked against what its info declares
    verdict = re.search(r"^\s*gate\s+acme_min_f1: (PASSED|FAILED) \(test macro-F1 ([\d.]+)", proc.stdout, re.M)
    assert verdict, f"no acme_min_f1 verdict in the summary:\n{proc.stdout[-3000:]}"

    # Read the run back from MLflow itself, not from our own output.
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("acme")
    runs = client.search_runs([experiment.experiment_id], "tags.`flyscale.model` = 'acme_tiny_mlp'")
    assert len(runs) == 1
    run = runs[0].data
    assert run.tags["flyscale.dataset"] == "acme-wine"  # the plugin's own info object, converted
    assert run.params["model.options.width"] == "32" and run.params["gate.gates.0.name"] == "acme_min_f1"
    assert run.params["augment.names"] == "[]"
    # The gate's verdict agrees with the metric it was judged on, in MLflow and in the summary.
    passed = run.metrics["test_macro_f1"] >= 0.9
    assert run.tags["gate.acme_min_f1"].startswith("passed" if passed else "failed")
    assert verdict.group(1) == ("PASSED" if passed else "FAILED")
    assert float(verdict.group(2)) == pytest.approx(run.metrics["test_macro_f1"], abs=1e-4)
    # Acme's model was really built for Acme's data: Linear(13 features, 32) + Linear(32, 3), 4 bytes each.
    weights = (13 * 32 + 32 + 32 * 3 + 3) * 4
    assert weights < run.metrics["test_size_bytes"] < weights + 4096
    # And it learned something: chance on 3 balanced-ish classes is about 0.4.
    assert run.metrics["test_accuracy"] > 0.8

    # Its model loads and answers where neither Acme's package nor flyscale nor torch is installed:
    # a fresh environment of the logged model's declared requirements (served from ONNX).
    import mlflow

    # A runs:/ URI finds its logged model through MLflow's global tracking URI, not the argument's.
    mlflow.set_tracking_uri(uri)
    logged = Path(mlflow.artifacts.download_artifacts(f"runs:/{runs[0].info.run_id}/model", dst_path=str(tmp_path)))
    code = (
        "import importlib.util, mlflow, numpy as np, sys\n"
        "assert not any(importlib.util.find_spec(m) for m in ('torch', 'flyscale', 'acme_flyscale'))\n"
        "p = mlflow.pyfunc.load_model(sys.argv[1]).predict(np.zeros((4, 13), dtype='float32'))\n"
        "assert p.shape == (4, 3) and abs(p.sum(axis=1) - 1).max() < 1e-5, p\n"
        "print('answered')\n"
    )
    fresh = subprocess.run(
        [str(fresh_python(logged, serving_envs)), "-c", code, str(logged)],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.returncode == 0 and "answered" in fresh.stdout, fresh.stderr[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_plugin_of_the_wrong_shape_is_refused_before_any_task_starts(site, tmp_path):
    preset = tmp_path / "wrong.yaml"
    preset.write_text(yaml.safe_dump({"model": {"name": "acme_no_build"}}))
    home = tmp_path / "home"
    home.mkdir()
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PYTHONPATH": _env(site)["PYTHONPATH"]}
    proc = run_pipeline(home, "--cfg", str(preset), env=env, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "model plugin 'acme_no_build'" in out and "has no method build(options, info)" in out, out[-3000:]
    # Nothing ran: no task started (flytekit logs each one it runs) and no MLflow store was made.
    assert "load_data" not in out and "train_model" not in out, out[-3000:]
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model, message",
    [
        (
            "acme_bn_mlp",
            "model 'acme_bn_mlp' cannot be trained with train.strategy 'pipeline' on 2 worker(s): the pipeline "
            "strategy cannot keep BatchNorm's running statistics right, and the model has 1 (BatchNorm1d): use "
            "LayerNorm or GroupNorm in the model, BatchNorm with track_running_stats=False, or train.strategy: ddp",
        ),
        (
            "acme_residual",
            "model 'acme_residual' cannot be trained with train.strategy 'pipeline' on 2 worker(s): the pipeline "
            "strategy cuts the model between its layers, so it needs an nn.Sequential, and this one is a Residual: "
            "build it as an nn.Sequential of whole layers, or use train.strategy: ddp",
        ),
    ],
)
@pytest.mark.slow
def test_a_model_its_strategy_cannot_train_is_refused_before_any_data_work(site, tmp_path, model, message):
    """A plugin's model the pipeline strategy cannot cut, or cannot keep right, fails in the check
    that runs first: no data read, nothing trained; the failed run is kept in MLflow."""
    preset = tmp_path / "wrong.yaml"
    preset.write_text(yaml.safe_dump({"model": {"name": model}, "train": {"strategy": "pipeline"}}))
    home = tmp_path / "home"
    home.mkdir()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri, "PYTHONPATH": _env(site)["PYTHONPATH"]}
    proc = run_pipeline(home, "--cfg", str(preset), env=env, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert message in " ".join(out.split()), out[-3000:]
    ran = re.findall(r"Invoking (tasks\.\w+\.\w+)", out)  # flytekit logs every task it starts
    assert ran == ["tasks.preflight.check_model"], ran
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("flyscale").experiment_id])
    assert run.info.status == "FAILED" and run.data.params["model.name"] == model


TYPED_USE = """
from flyscale.plugin import registry
from flyscale.api import DatasetInfo, GateVerdict
from flyscale.model import build_model
from flyscale.tracking.champion import ChampionRef
from flyscale.config import GateConfig, ModelConfig
from flyscale.evaluate.gating import judge

cfg = GateConfig(name="acme_max_loss", options={"max_loss": 0.3})
verdict = judge(cfg, {"loss": 0.25, "accuracy": 0.9}, ChampionRef("m", "champion")).verdict
assert type(verdict) is GateVerdict and verdict.passed, verdict
print(verdict.reason)
model = build_model(ModelConfig(name="acme_linear"), DatasetInfo("d", 3, [2, 2], ["a", "b", "c", "d"]))
print(model)
"""


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_plugins_written_against_flyscale_api_work_too(site):
    proc = _python(site, "-c", TYPED_USE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test loss 0.2500 <= 0.3" in proc.stdout
    assert "Linear(in_features=4, out_features=3" in proc.stdout


# Acme's strategy has only `parallelize` and `traits`; flyscale's trainer builds the optimizer, the
# step and the epochs around it. Alone, it is the ddp strategy alone: the same losses, bit for bit.
STRATEGY_USE = """
import torch
from flyscale.api import DistContext, TrainData, train
from flyscale.config import TrainConfig
from flyscale.train import strategies

x = torch.randn(96, 6, generator=torch.Generator().manual_seed(0))
y = (x[:, 0] > 0).long()
data = TrainData(x[:64], y[:64], x[64:], y[64:])
losses = {}
for name in ("acme_replicated", "ddp"):
    cfg = TrainConfig(strategy=name, epochs=3, batch_size=16, lr=1e-2, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    strategy, options = strategies.strategy(cfg)
    result = train(strategy, model, data, cfg, DistContext(), options)
    losses[name] = [m.train_loss for m in result.history.epochs]
    print(name, result.history.strategy, strategies.traits_of(strategy), strategies.reshards(cfg))
assert losses["acme_replicated"] == losses["ddp"], losses
assert losses["ddp"][-1] < losses["ddp"][0], losses
print("same losses", losses["ddp"])
"""


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_strategy_package_in_the_parallelize_form_trains_through_the_trainer(site):
    proc = _python(site, "-c", STRATEGY_USE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    traits = "StrategyTraits(per_worker_batch=True, meta_model=False, reshards=True)"  # its own, as declared
    assert f"acme_replicated acme_replicated {traits} True" in proc.stdout, proc.stdout
    assert "same losses" in proc.stdout


@pytest.mark.parametrize(
    "model,fallback,onnx_line,served",
    [
        # ONNX lacks an operator, and no fallback is configured: the export fails, naming it.
        ("acme_running_max", "none", "ONNX has no function for the operator aten.cummax (in the RunningMax", ""),
        # A forward that branches on the data, with export.fallback torch: the PyTorch model, plugin needed.
        ("acme_gated", "torch", "  onnx        not exported: the Gated could not be exported to ONNX", "FlyscaleModel"),
    ],
)
@pytest.mark.slow
def test_a_model_onnx_cannot_take_fails_its_export_or_registers_as_configured(
    site, tmp_path, model, fallback, onnx_line, served
):
    """Without export.fallback, a model ONNX cannot take fails the export stage with the cause;
    with export.fallback torch the run says what became of the export, the int8 copy falls back
    to torch.ao, and the registered PyTorch model loads where the plugin is installed."""
    cfg = {
        "data": {"dataset": "acme_wine"},
        "model": {"name": model},
        "gate": {"name": "min_metric", "options": {"threshold": 0.0}},
        "train": {"epochs": 2, "batch_size": 16},
        "export": {"fallback": fallback},
        "mlflow": {"experiment": "acme", "model_name": "acme-export"},
    }
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    home = tmp_path / "home"
    home.mkdir()
    env = {"MLFLOW_TRACKING_URI": uri, "PYTHONPATH": _env(site)["PYTHONPATH"]}
    proc = run_pipeline(home, "--cfg", json.dumps(cfg), env=env, timeout=280)
    if not served:
        out = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode != 0 and onnx_line in out, out[-3000:]
        assert "set export.fallback: torch to register the PyTorch model" in out
        assert "registered  acme-export" not in proc.stdout
        return
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    assert onnx_line in proc.stdout, proc.stdout[-3000:]
    assert "registered  acme-export v1" in proc.stdout
    assert "torch_dynamic_int8" in proc.stdout + proc.stderr  # the int8 fallback, said
    code = (
        "import mlflow, numpy as np\n"
        "m = mlflow.pyfunc.load_model('models:/acme-export@champion')\n"
        "p = m.predict(np.ones((2, 13), dtype='float32'))\n"
        "assert p.shape == (2, 3) and abs(p.sum(axis=1) - 1).max() < 1e-5, p\n"
        "print(type(m.unwrap_python_model()).__name__)\n"
    )
    where = _env(site)  # the PyTorch model needs the plugin's package
    loaded = subprocess.run(
        [sys.executable, "-c", code],
        env={**where, "MLFLOW_TRACKING_URI": uri},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip().endswith(served), loaded.stdout
