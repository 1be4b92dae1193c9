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


def _ctrl_c_after(home, args: list[str], env: dict, step: int, log_path) -> int:
    """`pyflyte run` of the pipeline as a user starts it, Ctrl-C'd (SIGINT to the terminal's
    process group) once a checkpoint of `step` or later is written; the newest step left.

    Ctrl-C keeps the work: every worker finishes its step, they stop together after one more
    checkpoint, at the step the run names as its last line, and the command exits 130 without a
    traceback."""
    base = home / ".flyscale" / "checkpoints"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "pyflyte"), "run", *PIPELINE, *args],
            cwd=REPO,
            env={**os.environ, **env, "HOME": str(home), "FLYTE_SDK_LOGGING_LEVEL": "20"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 400
        while _newest_step(base) < step:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        before = _newest_step(base)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(120)
    said, left = log_path.read_text(), _newest_step(base)
    assert code == 130, said[-3000:]
    assert f"interrupted at step {left}; the same command resumes" in said, said[-3000:]
    assert "Traceback" not in said and "IgnoreOutputs" not in said, said[-3000:]
    # The checkpoint at the interruption, written after the Ctrl-C by every rank (each its rank file).
    assert left > before and {p.name for p in next(base.glob(f"run-*/step-{left:09d}")).glob("rank-*.pt")} == {
        "rank-0.pt",
        "rank-1.pt",
    }
    return left


@pytest.mark.timeout(600)
def test_the_same_command_after_ctrl_c_resumes_and_ends_with_the_uninterrupted_weights(tmp_path, mlflow_server):
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    client = MlflowClient(mlflow_server)
    reference = run_pipeline(tmp_path / "reference", "--cfg", str(_config(tmp_path, "resume-reference")), env=env)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    # The user's run: Ctrl-C two checkpoints in.
    home, cfg = tmp_path / "user", _config(tmp_path, "resume-e2e")
    base = home / ".flyscale" / "checkpoints"
    home.mkdir()
    left = _ctrl_c_after(home, ["--cfg", str(cfg)], env, 2 * EVERY, tmp_path / "interrupted.log")
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


FSDP_EVERY = 20
FSDP_SMALL = {  # configs/text-gpt.yaml made small, on the fsdp strategy: 2 workers take 64 sequences a step
    "tokenize": {"seq_len": 32},
    "model": {"options": {"layers": 1, "heads": 2, "width": 32}},
    "train": {"strategy": "fsdp", "epochs": 1, "batch_size": 32},
    "recovery": {"checkpoint_every_steps": FSDP_EVERY},
    "mlflow": {"model_name": "reshard-e2e"},
}


@pytest.mark.timeout(600)
def test_a_stopped_fsdp_run_resumes_resharded_on_one_worker_fewer(tmp_path, mlflow_server):
    """The text preset on fsdp with 2 workers, Ctrl-C after two checkpoints; the same command on
    one worker resumes from the sharded checkpoint, keeping the global batch, and says so in the
    summary and in MLflow."""
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    home, cfg = tmp_path / "user", tmp_path / "fsdp.yaml"
    cfg.write_text(yaml.safe_dump(FSDP_SMALL))
    args = ["--cfg", str(REPO / "configs/text-gpt.yaml"), "--cfg", str(cfg)]
    base = home / ".flyscale" / "checkpoints"
    home.mkdir()
    left = _ctrl_c_after(home, args, {**env, "FLYSCALE_NPROC_PER_NODE": "2"}, 2 * FSDP_EVERY, tmp_path / "fsdp.log")
    shards = sorted(p.name for p in next(base.glob(f"run-*/step-{left:09d}")).glob("state/*"))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each of the 2 ranks wrote its own

    again = run_pipeline(home, *args, env={**env, "FLYSCALE_NPROC_PER_NODE": "1"})
    out = again.stdout
    assert again.returncode == 0, out[-3000:] + again.stderr[-3000:]
    assert f"  training    resumed from step {left} ({base}/run-" in out, out[-3000:]
    # The global batch kept, in micro-batches of the 32 rows each worker took before.
    assert "resharded from 2 workers to 1 (the global batch kept: 64 rows a worker, 2 micro-batches a step)" in out
    assert "registered  reshard-e2e v1" in out
    run_id = MlflowClient(mlflow_server).get_model_version("reshard-e2e", "1").run_id
    tag = MlflowClient(mlflow_server).get_run(run_id).data.tags["flyscale.resumed_from"]
    assert "resharded from 2 workers to 1" in tag
