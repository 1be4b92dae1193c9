"""Launchers chosen at registration: the classic PyTorchJob (master + workers) serialises with
per-replica resources, and run locally it trains in one process instead of waiting for peers."""

from __future__ import annotations

import os

import pytest

from tests.distributed_helpers import run_on_ranks


def _train_task_custom(monkeypatch, **env):
    """Build a task with the launcher those settings choose, as @task does, and serialise it."""
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.core.task import TaskPlugins

    from tasks import elastic

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = elastic.training_launcher()

    def fn(n: int) -> int:
        return n

    task = TaskPlugins.find_pythontask_plugin(type(config))(task_config=config, task_function=fn)
    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="d", fqn="img", tag="1")))
    return task, task.get_custom(settings)


def test_pytorchjob_launcher_has_master_workers_and_resources(monkeypatch):
    t, custom = _train_task_custom(
        monkeypatch, FLYSCALE_LAUNCHER="pytorch", FLYSCALE_NNODES="4", FLYSCALE_REPLICA_CPU="8", FLYSCALE_REPLICA_MEM="32Gi",
        FLYSCALE_REPLICA_GPU="1",
    )
    assert t.task_type == "pytorch"
    assert custom["workerReplicas"]["replicas"] == 3
    assert custom["masterReplicas"]["replicas"] == 1
    for replica in ("workerReplicas", "masterReplicas"):
        requests = {r["name"]: r["value"] for r in custom[replica]["resources"]["requests"]}
        assert requests == {"CPU": "8", "MEMORY": "32Gi", "GPU": "1"}


@pytest.mark.parametrize(
    "env, message",
    [({"FLYSCALE_LAUNCHER": "mpi"}, "FLYSCALE_LAUNCHER must be"), ({"FLYSCALE_LAUNCHER": "pytorch"}, "NNODES >= 2"),
     ({"FLYSCALE_NPROC_PER_NODE": "0"}, "must be >= 1")],
)
def test_bad_launcher_settings_are_named(monkeypatch, env, message):
    from tasks import elastic

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        elastic.training_launcher()


def _outputs_on_rank(elastic_agent: bool):
    from flytekit.core.base_task import IgnoreOutputs

    from flyscale.distributed import context_from_env, rank_zero_outputs

    if elastic_agent:
        os.environ["TORCHELASTIC_RUN_ID"] = "test"
    ctx = context_from_env()
    try:
        return rank_zero_outputs(ctx, f"weights from rank {ctx.rank}")
    except IgnoreOutputs:
        return "IgnoreOutputs"


@pytest.mark.timeout(120)
def test_only_rank_zero_returns_outputs_under_both_launchers():
    assert run_on_ranks(_outputs_on_rank, 2, True) == ["weights from rank 0", None]
    assert run_on_ranks(_outputs_on_rank, 2, False) == ["weights from rank 0", "IgnoreOutputs"]
