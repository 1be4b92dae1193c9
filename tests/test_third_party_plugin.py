"""A third-party plugin package, never mentioned in flyscale's code, used by name.

tests/example_plugin is built and installed with pip into a scratch directory put on
PYTHONPATH (the venv itself is left untouched); everything then runs in subprocesses, exactly
as a user would: `flyscale plugins`, config validation, and the whole pipeline under `pyflyte run`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import run_pipeline

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "tests" / "example_plugin"
DIST = "acme-flyscale-example 0.3.1"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package pip-installed into a scratch site directory (no network needed)."""
    root = tmp_path_factory.mktemp("thirdparty")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(root / "site"), str(src)],
        capture_output=True, text=True, timeout=180,
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
def test_flyscale_plugins_shows_third_party_and_broken_plugins(site):
    proc = _python(site, "-m", "flyscale.cli", "plugins")
    assert proc.returncode == 0, proc.stderr  # a broken plugin is reported, not fatal
    rows = {tuple(line.split()[:2]): line for line in proc.stdout.splitlines()}
    tiny = rows[("models", "acme_tiny_mlp")]
    assert "acme_flyscale.models:tiny_mlp" in tiny and DIST in tiny and tiny.rstrip().endswith("ok")
    gate = rows[("gates", "acme_min_f1")]
    assert "acme_flyscale.gates:min_f1" in gate and DIST in gate and gate.rstrip().endswith("ok")
    broken = rows[("models", "acme_broken")]
    assert DIST in broken
    assert "import error: ImportError: acme_flyscale.broken needs the 'acme-cuda-kernels' package" in broken
    # The broken one spoils nothing else.
    assert rows[("models", "mlp")].rstrip().endswith("ok")
    assert rows[("gates", "min_metric")].rstrip().endswith("ok")
    assert f"1 failed to import: models/acme_broken ({DIST})" in proc.stdout


CHECK_CONFIG = """
import sys
from flyscale.config import GateConfig, ModelConfig
kind, name, options = sys.argv[1], sys.argv[2], eval(sys.argv[3])
try:
    (ModelConfig if kind == "model" else GateConfig)(name=name, options=options)
except ValueError as exc:
    print(exc)
    sys.exit(3)
print("valid")
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind, name, options, expected",
    [
        ("model", "acme_tiny_mlp", "{'width': 32}", ["valid"]),
        ("gate", "acme_min_f1", "{'threshold': 0.8}", ["valid"]),
        # A broken plugin: named, with its package, its error, and what else there is.
        ("model", "acme_broken", "{}", [
            "model.name: model plugin 'acme_broken' from package 'acme-flyscale-example'",
            "acme-cuda-kernels", "Other models: acme_tiny_mlp, cnn, mlp",
        ]),
        ("model", "resnet9000", "{}", ["model.name: unknown model 'resnet9000'; available: acme_broken, acme_tiny_mlp, cnn, mlp"]),
        ("gate", "f1", "{}", ["gate.name: unknown gate 'f1'; available: acme_min_f1, beats_champion, min_metric"]),
        # The plugin's own options dataclass validates its section, field by field.
        ("model", "acme_tiny_mlp", "{'width': 0}", ["model.options: width must be > 0, got 0"]),
        ("model", "acme_tiny_mlp", "{'depth': 3}", ["model.options.depth: unknown option; expected one of width"]),
        ("gate", "acme_min_f1", "{'threshold': 1.5}", ["gate.options: threshold must be in [0, 1], got 1.5"]),
    ],
)
def test_config_validation_with_third_party_plugins(site, kind, name, options, expected):
    proc = _python(site, "-c", CHECK_CONFIG, kind, name, options)
    assert proc.returncode == (0 if expected == ["valid"] else 3), proc.stdout + proc.stderr
    for text in expected:
        assert text in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_pipeline_runs_with_plugins_selected_by_name(site, tmp_path):
    """THE end-to-end: a YAML preset picks Acme's model and gate; pyflyte runs every stage."""
    preset = tmp_path / "acme.yaml"
    preset.write_text(yaml.safe_dump({
        "augment": {"copies": 0},
        "model": {"name": "acme_tiny_mlp", "options": {"width": 64}},
        "gate": {"name": "acme_min_f1", "options": {"threshold": 0.9}},
        "train": {"epochs": 5, "batch_size": 64},
        "mlflow": {"experiment": "acme", "model_name": "acme-digits"},
    }))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri, "PYTHONPATH": _env(site)["PYTHONPATH"]}
    home = tmp_path / "home"  # isolated flytekit local cache
    home.mkdir()
    proc = run_pipeline(home, "--cfg", str(preset), env=env, timeout=280)
    assert proc.returncode == 0, f"pyflyte run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "flyscale run summary" in proc.stdout, proc.stdout[-3000:]
    verdict = re.search(r"^\s*gate\s+acme_min_f1: (PASSED|FAILED) \(test macro-F1 ([\d.]+)", proc.stdout, re.M)
    assert verdict, f"no acme_min_f1 verdict in the summary:\n{proc.stdout[-3000:]}"

    # Read the run back from MLflow itself, not from our own output.
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("acme")
    runs = client.search_runs([experiment.experiment_id], "tags.`flyscale.model` = 'acme_tiny_mlp'")
    assert len(runs) == 1
    run = runs[0].data
    assert run.params["model.options.width"] == "64" and run.params["gate.name"] == "acme_min_f1"
    # The gate's verdict agrees with the metric it was judged on, in MLflow and in the summary.
    passed = run.metrics["test_macro_f1"] >= 0.9
    assert run.tags["gate.acme_min_f1"].startswith("passed" if passed else "failed")
    assert verdict.group(1) == ("PASSED" if passed else "FAILED")
    assert float(verdict.group(2)) == pytest.approx(run.metrics["test_macro_f1"], abs=1e-4)
    # Acme's model was really built: Linear(64 features, 64) + Linear(64, 10), float32, 4 bytes each.
    weights = (64 * 64 + 64 + 64 * 10 + 10) * 4
    assert weights < run.metrics["test_size_bytes"] < weights + 4096
