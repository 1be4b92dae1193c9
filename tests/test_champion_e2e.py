"""`beats_champion` through real `pyflyte run`: the first model becomes champion, a worse one does not."""

from __future__ import annotations

import re

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import run_pipeline


def _cfg(tmp_path, name: str, epochs: int):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "augment": {"copies": 0},
        "train": {"epochs": epochs, "batch_size": 64},
        "gate": {"name": "beats_champion"},  # no options: the gate's own defaults apply
        "mlflow": {"experiment": "champion-e2e", "model_name": "champion-e2e"},
    }))
    return path


@pytest.mark.timeout(900)
def test_only_a_better_model_takes_the_alias(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    good = run_pipeline(tmp_path, "--cfg", str(_cfg(tmp_path, "good", 8)), env=env)
    assert good.returncode == 0, good.stderr[-4000:]
    assert "beats_champion: PASSED (no champion yet" in good.stdout

    worse = run_pipeline(tmp_path, "--cfg", str(_cfg(tmp_path, "worse", 1)), env=env)
    assert worse.returncode == 0, worse.stderr[-4000:]
    assert re.search(r"beats_champion: FAILED \(test accuracy 0\.\d+ <= champion v1 ", worse.stdout), worse.stdout

    client = MlflowClient(uri)
    assert str(client.get_model_version_by_alias("champion-e2e", "champion").version) == "1"
    versions = {str(v.version): v.tags["flyscale.gates"] for v in client.search_model_versions("name='champion-e2e'")}
    assert versions == {"1": "passed", "2": "failed"}
