"""Ctrl-C, then the same command again, through real `pyflyte run` against a real MLflow server:
the second run resumes from the checkpoint the first left, and registers the very weights a run
never interrupted registers."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import yaml
from mlflow import MlflowClient

from flyscale.tracking.champion import WEIGHTS_TAG
from flyscale.train.checkpoint_files import complete_checkpoints, step_of
from tests.conftest import BIN, PIPELINE, REPO, run_pipeline

EVERY = 20  # steps between checkpoints; 30 epochs of digits are 300 steps on 2 workers


def _config(tmp_path, model_name: str):
    path = tmp_path / f"{model_name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "augment": {"copies": 0},
                "train": {"epochs": 30, "batch_size": 64},
                "recovery": {"checkpoint_every_steps": EVERY},
                "mlflow": {"model_name": model_name},
            }
        )
    )
    return path


def _weights(client: MlflowClient, name: str) -> str:
    return client.get_model_version(name, "1").tags[WEIGHTS_TAG]


def _newest_step(base) -> int:
    return max((step_of(p) for run in base.glob("run-*") for p in complete_checkpoints(run)), default=0)


@pytest.mark.timeout(600)
def test_the_same_command_after_ctrl_c_resumes_and_ends_with_the_uninterrupted_weights(tmp_path, mlflow_server):
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    client = MlflowClient(mlflow_server)
    reference = run_pipeline(tmp_path / "reference", "--cfg", str(_config(tmp_path, "resume-reference")), env=env)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    # The user's run: Ctrl-C (SIGINT to the terminal's process group) two checkpoints in.
    home, cfg = tmp_path / "user", _config(tmp_path, "resume-e2e")
    base = home / ".flyscale" / "checkpoints"
    home.mkdir()
    with open(tmp_path / "interrupted.log", "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "pyflyte"), "run", *PIPELINE, "--cfg", str(cfg)],
            cwd=REPO,
            env={**os.environ, **env, "HOME": str(home), "FLYTE_SDK_LOGGING_LEVEL": "20"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while _newest_step(base) < 2 * EVERY:
            assert proc.poll() is None, (tmp_path / "interrupted.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(120) != 0
    left = _newest_step(base)
    assert 2 * EVERY <= left < 300, f"interrupted at step {left}: not mid-training"

    again = run_pipeline(home, "--cfg", str(cfg), env=env)
    out = again.stdout
    assert again.returncode == 0, out[-3000:] + again.stderr[-3000:]
    assert f"  training    resumed from step {left} ({base}/run-" in out, out[-3000:]
    assert f"; {300 - left} of 300 steps computed after it" in out
    assert _weights(client, "resume-e2e") == _weights(client, "resume-reference")
    assert not list(base.glob("run-*")), "a finished training leaves its checkpoints behind"
    # The interrupted execution kept its MLflow run, failed, with its params.
    runs = client.search_runs(
        [client.get_experiment_by_name("flyscale").experiment_id],
        "params.`mlflow.model_name` = 'resume-e2e'",
    )
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"], [r.info for r in runs]
