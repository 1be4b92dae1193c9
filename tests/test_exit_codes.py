"""The training pod's exit code follows the PyTorchJob convention (restartPolicy: ExitCode):
permanent failures exit 1-127, retryable ones 128-255. Real processes: the training task's own
container command (`python -m flyscale.cluster.exit_codes pyflyte-execute ...`, as `pyflyte package` writes
it) wraps a task under flytekit's Elastic launcher whose worker fails, is killed, or succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flyscale.cluster import exit_codes
from tests.conftest import REPO

# A training-shaped task: torch-elastic workers under our launcher, failing as told.
TASK = textwrap.dedent("""
    import os, signal, sys, time
    from flytekit import task
    from flyscale.cluster.launchers import LocalSafeElastic, worker_start_method

    @task(task_config=LocalSafeElastic(nnodes=1, nproc_per_node=2, max_restarts=0, monitor_interval=0.1,
                                       start_method=worker_start_method(2)))
    def train(how: str) -> int:
        if os.environ["RANK"] == "1":
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "bug":
                raise ValueError("a bug in the training code")
        if how == "hang":
            time.sleep(600)
        return 0

    train(how=sys.argv[1])
""")


def _wrapped(tmp_path, how: str, **popen) -> subprocess.Popen:
    script = tmp_path / "train_task.py"  # a file: flytekit reads the task's source
    script.write_text(TASK)
    return subprocess.Popen(
        [sys.executable, "-m", "flyscale.cluster.exit_codes", sys.executable, str(script), how],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


@pytest.mark.timeout(240)
# Success (0), and a worker without rank 0 (IgnoreOutputs, also 0): tests/test_operator_sim.py.
@pytest.mark.parametrize("how, code", [("bug", exit_codes.PERMANENT), ("killed", exit_codes.RETRYABLE)])
@pytest.mark.slow
def test_the_wrapper_exits_by_the_pytorchjob_convention(tmp_path, how, code):
    proc = _wrapped(tmp_path, how)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == code, out[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_terminated_pod_exits_retryable(tmp_path):
    """The kubelet's SIGTERM (a preempted node) reaches the task, and the pod exits 128 + 15."""
    proc = _wrapped(tmp_path, "hang", start_new_session=True)
    # Whether the agent is up yet (it stops its workers and flytekit raises IgnoreOutputs) or not
    # (the process dies of the signal), the pod exits 128 + 15.
    time.sleep(4)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]


def test_the_serialised_training_task_runs_under_the_wrapper():
    from flytekit.configuration import ImageConfig, SerializationSettings

    from tasks.train import train_model

    settings = SerializationSettings(image_config=ImageConfig.auto(img_name="ghcr.io/acme/flyscale@sha256:" + "0" * 64))
    command = train_model.get_default_command(settings)
    assert command[:4] == ["python", "-m", "flyscale.cluster.exit_codes", "pyflyte-execute"], command
