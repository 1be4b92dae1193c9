"""The PyTorchJob path without a cluster: the training task as `pyflyte package` serialised it,
its container command run as the training operator runs it, in N local "pods" (processes), each
with the environment the operator gives its pod. Inputs and outputs go through a real S3 server
on loopback (moto). No local `pyflyte run` touches this code path: the pods import the task
module afresh, rendezvous across "nodes", and only global rank 0 writes the outputs.

Each pod has a filesystem root of its own (its own HOME), as each node of a cluster has its own
disk: the default `recovery.checkpoint_dir` (~/.flyscale/checkpoints) is a directory per pod,
and the job is refused before training. A job that checkpoints gives every pod one path they
all see (`VOLUME`), as a ReadWriteMany volume mounted in every pod would be."""

from __future__ import annotations

import os
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest
from flyteidl.admin.task_pb2 import TaskSpec
from flyteidl.core.literals_pb2 import LiteralMap as LiteralMapPb

from flyscale.data.prepare import prepare_table, prepared_frames
from tests.conftest import BIN, REPO, free_port

IMAGE = "ghcr.io/acme/flyscale@sha256:" + "7" * 64
VOLUME = "volume"  # under the test's tmp_path: the checkpoint directory every pod mounts


_PACKAGED: dict[tuple, TaskSpec] = {}  # by launcher settings: tests that register alike share one package


def _packaged_train_task(tmp_path: Path, **launcher: str) -> TaskSpec:
    key = tuple(sorted(launcher.items()))
    if key not in _PACKAGED:
        _PACKAGED[key] = _package(tmp_path, **launcher)
    spec = TaskSpec()
    spec.CopyFrom(_PACKAGED[key])
    return spec


def _package(tmp_path: Path, **launcher: str) -> TaskSpec:
    out = tmp_path / "pkg.tgz"
    proc = subprocess.run(
        [str(BIN / "pyflyte"), "--pkgs", "workflows", "package", "--image", IMAGE, "-f", "-o", str(out)],
        cwd=REPO,
        env={**os.environ, "HOME": str(tmp_path), **launcher},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            if member.name.endswith("_1.pb"):
                spec = TaskSpec()
                spec.ParseFromString(tar.extractfile(member).read())
                if spec.template.id.name == "tasks.train.train_model":
                    return spec
    raise AssertionError("no tasks.train.train_model in the package")


def _flyte_s3_env(endpoint: str) -> dict[str, str]:
    """How flytekit in a pod reaches the object store (what a cluster's task pods are given)."""
    return {
        "FLYTE_AWS_ENDPOINT": endpoint,
        "FLYTE_AWS_ACCESS_KEY_ID": "testing",
        "FLYTE_AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def _inputs(tmp_path: Path, prefix: str, endpoint: str, monkeypatch, strategy: str = "ddp", **recovery) -> str:
    """train_model's inputs, as the upstream tasks would have left them: literals in S3 and the
    training and validation shards uploaded to the raw-data prefix. `recovery`: RecoveryConfig's
    fields (by default checkpoints in each pod's own ~/.flyscale/checkpoints)."""
    from flytekit.configuration import DataConfig as FlyteDataConfig
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.data_persistence import FileAccessProvider
    from flytekit.core.type_engine import TypeEngine

    from flyscale.config import (
        DataConfig,
        MlflowConfig,
        ModelConfig,
        RecoveryConfig,
        TrainConfig,
    )
    from flyscale.data import shards
    from flyscale.data import source as data
    from flyscale.flyte.provenance import TaskRun
    from flyscale.train.preflight import PreflightReport
    from tasks.train import train_model

    for k, v in _flyte_s3_env(endpoint).items():
        monkeypatch.setenv(k, v)
    cfg = DataConfig()
    frame, info = data.load(cfg)
    train, val, _ = prepared_frames(prepare_table(frame, cfg, info))
    values = {
        "train": shards.write(train, "train"),
        "val": shards.write(val, "val"),
        "info": info,
        "model_cfg": ModelConfig(),
        "cfg": TrainConfig(strategy=strategy, epochs=2, batch_size=32),
        "preflight": PreflightReport(passed=True, world_size=0),
        "fingerprint": data.fingerprint(cfg),
        "started": TaskRun.start("fingerprint_data", execution="pytorchjob-sim"),
        "mlflow_cfg": MlflowConfig(experiment="operator-sim"),
        "recovery": RecoveryConfig(**recovery),
    }
    types = {name: train_model.python_interface.inputs[name] for name in values}
    access = FileAccessProvider(
        local_sandbox_dir=str(tmp_path / "sandbox"),
        raw_output_prefix=f"{prefix}/upstream",
        data_config=FlyteDataConfig.auto(),
    )
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_file_access(access)) as upload:
        literals = TypeEngine.dict_to_literal_map(upload, values, types)
        local = tmp_path / "inputs.pb"
        local.write_bytes(literals.to_flyte_idl().SerializeToString())
        access.put_data(str(local), f"{prefix}/inputs.pb")
    return f"{prefix}/inputs.pb"


def _pods(spec: TaskSpec, inputs: str, prefix: str, tmp_path: Path, endpoint: str, envs: list[dict]) -> list:
    values = {
        "{{.input}}": inputs,
        "{{.outputPrefix}}": f"{prefix}/outputs",
        "{{.rawOutputDataPrefix}}": f"{prefix}/raw",
        "{{.checkpointOutputPrefix}}": f"{prefix}/checkpoint",
        "{{.prevCheckpointPrefix}}": "",
    }
    args = [values.get(a, a) for a in spec.template.container.args]
    registered = {e.key: e.value for e in spec.template.container.env}  # the task's own environment
    pods = []
    for i, pod_env in enumerate(envs):
        env = {
            **os.environ,
            **registered,
            **_flyte_s3_env(endpoint),
            **pod_env,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),
            "HOME": str(tmp_path / f"home{i}"),
            # The execution every pod of the job belongs to (flytepropeller sets these).
            "FLYTE_INTERNAL_EXECUTION_PROJECT": "flyscale",
            "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development",
            "FLYTE_INTERNAL_EXECUTION_ID": "pytorchjobsim",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        }
        for name in (
            "FLYSCALE_NNODES",
            "FLYSCALE_NPROC_PER_NODE",
            "FLYSCALE_LAUNCHER",
        ):  # the pod has only what was registered
            if name not in registered:
                env.pop(name, None)
        log = open(tmp_path / f"pod{i}.log", "w")
        pods.append(
            (subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), tmp_path / f"pod{i}.log")
        )
    return pods


def _outputs(prefix: str, tmp_path: Path):
    from flytekit.configuration import DataConfig as FlyteDataConfig
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.data_persistence import FileAccessProvider
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import LiteralMap

    from flyscale.train.telemetry import TrainHistory
    from tasks.records import ModelBundle

    access = FileAccessProvider(
        local_sandbox_dir=str(tmp_path / "read"), raw_output_prefix=f"{prefix}/read", data_config=FlyteDataConfig.auto()
    )
    local = tmp_path / "outputs.pb"
    access.get_data(f"{prefix}/outputs/outputs.pb", str(local))
    pb = LiteralMapPb()
    pb.ParseFromString(local.read_bytes())
    literals = LiteralMap.from_flyte_idl(pb).literals
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_file_access(access)) as read:
        model = TypeEngine.to_python_value(read, literals["model"], ModelBundle)
        history = TypeEngine.to_python_value(read, literals["history"], TrainHistory)
    return literals, model, history


def _wait(pods, exit_code: int = 0) -> list[str]:
    """Every pod's log, once each has exited with `exit_code`."""
    try:
        for proc, _ in pods:
            proc.wait(300)
    finally:  # a pod still running after the others' time is up is stuck: stop it
        for proc, _ in pods:
            if proc.poll() is None:
                proc.kill()
    logs = [log.read_text() for _, log in pods]
    for (proc, _), text in zip(pods, logs):
        assert proc.returncode == exit_code, text[-5000:]
    return logs


def _checkpointing(tmp_path: Path) -> dict:
    """Checkpoints every few steps, in one directory every pod mounts."""
    return {"checkpoint_dir": str(tmp_path / VOLUME), "checkpoint_every_steps": 5}


def _elastic_pods(i: int, rdzv: str) -> dict[str, str]:
    """What the training operator puts in pod `i` of an elastic PyTorchJob (elasticPolicy: 2:2 nodes)."""
    return {
        "PET_NNODES": "2:2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(i),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": rdzv,
        "PET_MAX_RESTARTS": "1",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(free_port()),
    }


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_two_elastic_nodes_rendezvous_train_and_rank_zero_writes_the_outputs(tmp_path, s3, moto_endpoint, monkeypatch):
    client, bucket = s3
    prefix = f"s3://{bucket}/job"
    spec = _packaged_train_task(tmp_path, FLYSCALE_NNODES="2", FLYSCALE_NPROC_PER_NODE="1")
    assert spec.template.type == "pytorch"
    inputs = _inputs(tmp_path, prefix, moto_endpoint, monkeypatch, **_checkpointing(tmp_path))
    rdzv = f"localhost:{free_port()}"
    operator = [_elastic_pods(i, rdzv) for i in range(2)]
    logs = _wait(_pods(spec, inputs, prefix, tmp_path, moto_endpoint, operator))
    literals, model, history = _outputs(prefix, tmp_path)
    assert set(literals) == {"model", "history", "run"}
    assert history.world_size == 2 and history.strategy == "ddp"  # one process on each of two "nodes"
    assert history.checkpoints_saved >= 2, history.checkpoints_saved  # both pods wrote theirs on the volume
    assert len(history.epochs) == 2 and history.epochs[-1].val_accuracy > 0.5
    weights = model.weights.remote_source
    assert weights.startswith(f"s3://{bucket}/job/raw"), weights  # rank 0 uploaded the model to the object store
    listed = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="job/outputs/")["Contents"]}
    assert {"job/outputs/outputs.pb", "job/outputs/deck.html"} <= listed, listed  # and rank 0's Learning curves
    # One writer: the pod without global rank 0 raised IgnoreOutputs, and still exited 0.
    skipped = ["Outputs.pb will not be uploaded" in log for log in logs]
    assert sorted(skipped) == [False, True], [log[-2000:] for log in logs]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_classic_pytorchjob_master_and_worker_train_fsdp_and_the_master_writes_the_outputs(
    tmp_path, s3, moto_endpoint, monkeypatch
):
    """Two pods, each one process, the model sharded between them (fsdp): each pod holds half."""
    client, bucket = s3
    prefix = f"s3://{bucket}/job"
    spec = _packaged_train_task(tmp_path, FLYSCALE_LAUNCHER="pytorch", FLYSCALE_NNODES="2")
    assert spec.template.type == "pytorch"
    assert list(spec.template.container.args)[:3] == ["python", "-m", "flyscale.cluster.exit_codes"]
    inputs = _inputs(tmp_path, prefix, moto_endpoint, monkeypatch, strategy="fsdp", **_checkpointing(tmp_path))
    # What the training operator puts in the master's and the worker's pod: one process each.
    master = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    logs = _wait(
        _pods(spec, inputs, prefix, tmp_path, moto_endpoint, [{**master, "RANK": "0"}, {**master, "RANK": "1"}])
    )
    _, _, history = _outputs(prefix, tmp_path)
    assert history.world_size == 2 and history.strategy == "fsdp" and len(history.epochs) == 2
    assert history.checkpoints_saved >= 2, history.checkpoints_saved  # each pod its shards, on the volume
    assert history.epochs[-1].val_accuracy > 0.5
    # The default MLP's parameters, gradients and AdamW state (4 floats a parameter), split between the two pods.
    from flyscale.config import DataConfig, ModelConfig
    from flyscale.data import source
    from flyscale.model import build_model

    whole = 16 * sum(p.numel() for p in build_model(ModelConfig(), source.info(DataConfig())).parameters()) / 2**20
    assert len(history.state_mb) == 2 and max(history.state_mb) < 0.6 * whole, (history.state_mb, whole)
    assert ["Outputs.pb will not be uploaded" in log for log in logs] == [False, True]  # the worker pod wrote nothing


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_two_pods_with_checkpoint_directories_of_their_own_are_refused_before_training(
    tmp_path, s3, moto_endpoint, monkeypatch
):
    """Nothing mounted: each pod's default checkpoint directory is on its own disk. Both pods fail
    before training, with one message saying what to mount, and exit as a permanent failure (a
    retry would meet the same mounts), not as a lost peer. (A classic PyTorchJob: one process a
    pod, so each pod's exit code is its worker's.)"""
    from flyscale.cluster.exit_codes import PERMANENT

    client, bucket = s3
    prefix = f"s3://{bucket}/job"
    spec = _packaged_train_task(tmp_path, FLYSCALE_LAUNCHER="pytorch", FLYSCALE_NNODES="2")
    inputs = _inputs(tmp_path, prefix, moto_endpoint, monkeypatch)  # recovery's defaults: checkpoints on
    master = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    pods = [{**master, "RANK": "0"}, {**master, "RANK": "1"}]
    logs = _wait(_pods(spec, inputs, prefix, tmp_path, moto_endpoint, pods), PERMANENT)
    for log in logs:
        assert "recovery.checkpoint_dir is not shared by every node of this training" in log, log[-5000:]
        assert "Mount a ReadWriteMany volume" in log and "FLYSCALE_NNODES=1" in log, log[-5000:]
        assert "epoch 1/2" not in log and "lost its peers" not in log, log[-5000:]
    rank0 = tmp_path / "home0" / ".flyscale" / "checkpoints"
    (run,) = rank0.glob("run-*")
    assert f"rank 0 (host {socket.gethostname()}) wrote in {run}" in logs[0]
    assert (
        f"rank 1 (host {socket.gethostname()}) at {tmp_path / 'home1' / '.flyscale' / 'checkpoints' / run.name}"
        in logs[0]
    )
    for home in ("home0", "home1"):  # no checkpoint, and no probe left behind
        assert not [
            p for p in (tmp_path / home / ".flyscale" / "checkpoints").rglob("*") if p.name != ".lock" and p.is_file()
        ]
    listed = client.list_objects_v2(Bucket=bucket, Prefix="job/outputs/").get("Contents", [])
    assert not [o["Key"] for o in listed if o["Key"].endswith("outputs.pb")]
