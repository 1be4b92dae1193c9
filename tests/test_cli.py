"""`flyscale plugins`: every installed plugin, by kind, with its entry point, distribution and status."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from flyscale import cli
from flyscale.plugin import registry
from flyscale.plugin.registry import PluginInfo

REPO = Path(__file__).resolve().parents[1]
BUILT_INS = {
    "datasets": ["digits"],
    "models": ["mlp", "cnn"],
    "strategies": ["ddp"],
    "quantizers": ["dynamic_int8"],
    "gates": ["min_metric"],
}

pytestmark = pytest.mark.timeout(120)


def _flyscale(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it (stdout is a pipe here, so the plain listing is printed)."""
    return subprocess.run(
        [sys.executable, "-m", "flyscale.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=90
    )


def _rows(stdout: str) -> dict[tuple[str, str], str]:
    """{(kind, name): whole line} from the plain listing."""
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["KIND", "NAME", "ENTRY"], stdout
    return {tuple(line.split()[:2]): line for line in lines[1:-1]}


@pytest.mark.slow
def test_plugins_lists_built_ins_with_their_distribution():
    proc = _flyscale("plugins")
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    dist = f"flyscale {version('flyscale')}"
    for kind, names in BUILT_INS.items():
        for name in names:
            line = rows.get((kind, name))
            assert line is not None, f"{kind}/{name} missing from:\n{proc.stdout}"
            assert dist in line and line.rstrip().endswith("ok"), line
            assert "flyscale_plugins." in line and f":{name}" in line  # the "module:attr" it came from
    # Nothing registered is left out, whichever plugins are installed.
    listed = {key for key in rows}
    assert listed == {(kind, name) for kind, reg in registry.ALL.items() for name in reg.names()}
    assert proc.stdout.splitlines()[-1].startswith(f"{len(rows)} plugins, ")


@pytest.mark.slow
def test_plugins_kind_filter():
    proc = _flyscale("plugins", "--kind", "models")
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    assert {kind for kind, _ in rows} == {"models"}
    assert {("models", "mlp"), ("models", "cnn")} <= set(rows)


def test_unknown_kind_is_a_usage_error_listing_the_kinds():
    proc = _flyscale("plugins", "--kind", "widgets")
    assert proc.returncode == 2
    assert "invalid choice: 'widgets'" in proc.stderr and "models" in proc.stderr


def test_rich_table_shows_broken_plugin_error():
    """The terminal rendering keeps every field, and a broken plugin's error, readable."""
    from rich.console import Console

    infos = [
        PluginInfo("models", "mlp", "flyscale_plugins.models:mlp", "flyscale 0.1.0"),
        PluginInfo("models", "bad", "acme.bad:plugin", "acme-bad 1.0", "ImportError: no module named torchvision"),
    ]
    console = Console(record=True, width=200, color_system=None)
    cli.render_rich(infos, console)
    text = console.export_text()
    assert "flyscale.models" in text
    assert "flyscale_plugins.models:mlp" in text and "flyscale 0.1.0" in text
    assert "acme-bad 1.0" in text and "broken: ImportError: no module named torchvision" in text
    assert cli._summary(infos) == "2 plugins, 1 broken: models/bad (acme-bad 1.0)"


@pytest.mark.slow
def test_a_command_on_the_registry_where_there_is_no_store_says_so_and_creates_none(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flyscale"), "rollback", "--model", "m", "--to", "2", "--reason", "x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"tracking store: sqlite:///{tmp_path / 'mlflow.db'}" in proc.stderr
    assert f"there is no tracking store at {tmp_path / 'mlflow.db'} (none was created)" in proc.stderr
    assert "MLFLOW_TRACKING_URI" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_store_that_fails_is_one_line_that_never_shows_its_password():
    """MLflow's own error names the URL it called: the CLI says it in one line, as the tracking
    store's failure, and the credentials are not in it (flyscale moved them out of the URI into
    MLflow's MLFLOW_TRACKING_USERNAME/PASSWORD before MLflow saw it)."""
    from tests.conftest import free_port

    uri = f"http://alice:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flyscale"), "rollback", "--model", "m", "--to", "2", "--reason", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    shown = uri.replace("alice:s3cret@", "")
    assert proc.returncode == 1 and "s3cret" not in proc.stdout + proc.stderr, proc.stderr
    store, failed = proc.stderr.splitlines()  # two lines: no traceback
    assert store == f"tracking store: {shown}"
    assert failed.startswith(f"flyscale rollback: the tracking store at {shown} failed: API request to {shown}/")


def test_a_password_in_a_uri_is_never_shown():
    from flyscale.tracking.store import shown

    assert shown("postgresql://mlflow:pa:ss@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert shown("https://user:secret@mlflow.example.com") == "https://user:***@mlflow.example.com"
    assert shown("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert shown("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


def test_help_points_to_the_training_command():
    proc = _flyscale("--help")
    text = " ".join(proc.stdout.split())  # argparse wraps at the terminal's width
    assert proc.returncode == 0 and "To train: pyflyte run workflows/train.py training_pipeline" in text
