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

    from flyscale.cluster import launchers as elastic

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = elastic.training_launcher()

    def fn(n: int) -> int:
        return n

    task = TaskPlugins.find_pythontask_plugin(type(config))(task_config=config, task_function=fn)
    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="d", fqn="img", tag="1")))
    return task, task.get_custom(settings)


def test_pytorchjob_launcher_has_master_workers_and_resources(monkeypatch):
    from flyscale.cluster import resources

    cluster = resources.ClusterResources.from_dict(
        {"training": {"cpu_per_process": "8", "mem_per_process": "32Gi", "gpu_per_process": 1}}, "a test's cluster file"
    )
    monkeypatch.setattr(resources, "CLUSTER", cluster)  # one process per pod: each asks for one process's share
    t, custom = _train_task_custom(monkeypatch, FLYSCALE_LAUNCHER="pytorch", FLYSCALE_NNODES="4")
    assert t.task_type == "pytorch"
    assert custom["workerReplicas"]["replicas"] == 3
    assert custom["masterReplicas"]["replicas"] == 1
    for replica in ("workerReplicas", "masterReplicas"):
        requests = {r["name"]: r["value"] for r in custom[replica]["resources"]["requests"]}
        assert requests == {"CPU": "8", "MEMORY": "32Gi", "GPU": "1"}


def test_an_elastic_range_of_nodes_serialises_as_the_pytorchjobs_min_and_max_replicas(monkeypatch):
    from flyscale.cluster import launcher_settings

    t, custom = _train_task_custom(monkeypatch, FLYSCALE_NNODES="1:4", FLYSCALE_NPROC_PER_NODE="2")
    assert custom["elasticConfig"]["minReplicas"] == 1 and custom["elasticConfig"]["maxReplicas"] == 4
    assert custom["workerReplicas"]["replicas"] == 4 and custom["elasticConfig"]["nprocPerNode"] == 2
    assert launcher_settings.planned_world_size() == 8  # the most it trains on: what the preflight plans for


def test_a_mesh_fixes_the_local_workers_and_a_cluster_keeps_what_was_registered(monkeypatch):
    """A hybrid mesh of 2 x 2 starts 4 workers locally whatever the launcher's processes per node;
    on a cluster the registered PyTorchJob's size stands (the strategy's check then names a mismatch)."""
    from flyscale.cluster import launcher_settings
    from flyscale.config import TrainConfig

    mesh = TrainConfig(strategy="hybrid", options={"mesh": {"dp": 2, "pp": 2}})
    monkeypatch.setenv("FLYSCALE_NPROC_PER_NODE", "2")
    assert launcher_settings.planned_world_size(mesh, local=True) == 4
    assert launcher_settings.planned_world_size(TrainConfig(), local=True) == 2  # ddp: the launcher decides
    assert launcher_settings.planned_world_size(mesh) == 2  # a cluster: as registered
    monkeypatch.setenv("FLYSCALE_NNODES", "2")
    assert launcher_settings.planned_world_size(mesh) == 4


def test_bad_cluster_resources_are_named(tmp_path, monkeypatch):
    from flyscale.cluster import resources

    with pytest.raises(ValueError, match=r"f.yaml: training.gpus is not a setting; training takes \["):
        resources.ClusterResources.from_dict({"training": {"gpus": 1}}, "f.yaml")
    with pytest.raises(ValueError, match=r"training.mem_per_process: '4GB' is not a Kubernetes quantity"):
        resources.ClusterResources.from_dict({"training": {"mem_per_process": "4GB"}}, "f.yaml")
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['evaluate'\]"):
        resources.ClusterResources.from_dict({"evaluate": {}}, "f.yaml")
    monkeypatch.setenv("FLYSCALE_RESOURCES", str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError, match=r"FLYSCALE_RESOURCES=.*missing.yaml: no such file"):
        resources.load()
    assert resources.ClusterResources().training.resources(4).cpu == "4"  # scales with the processes


@pytest.mark.parametrize(
    "env, message",
    [
        ({"FLYSCALE_LAUNCHER": "mpi"}, "FLYSCALE_LAUNCHER must be"),
        ({"FLYSCALE_LAUNCHER": "pytorch"}, "NNODES >= 2"),
        ({"FLYSCALE_NPROC_PER_NODE": "0"}, "must be >= 1"),
        ({"FLYSCALE_NNODES": "4:2"}, r"a range needs 1 <= MIN <= MAX"),
        ({"FLYSCALE_NNODES": "1:x"}, r"a whole number or a range MIN:MAX, got '1:x'"),
        ({"FLYSCALE_LAUNCHER": "pytorch", "FLYSCALE_NNODES": "2:4"}, "a range of nodes is torch-elastic's"),
    ],
)
def test_bad_launcher_settings_are_named(monkeypatch, env, message):
    from flyscale.cluster import launchers as elastic

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        elastic.training_launcher()


def _outputs_on_rank(elastic_agent: bool):
    from flytekit.core.base_task import IgnoreOutputs

    from flyscale.train.distributed import context_from_env, rank_zero_outputs

    if elastic_agent:
        os.environ["TORCHELASTIC_RUN_ID"] = "test"
    ctx = context_from_env()
    try:
        return rank_zero_outputs(ctx, f"weights from rank {ctx.rank}")
    except IgnoreOutputs:
        return "IgnoreOutputs"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_only_rank_zero_returns_outputs_under_both_launchers():
    assert run_on_ranks(_outputs_on_rank, 2, True) == ["weights from rank 0", None]
    assert run_on_ranks(_outputs_on_rank, 2, False) == ["weights from rank 0", "IgnoreOutputs"]
