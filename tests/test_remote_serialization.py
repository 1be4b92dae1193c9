"""What a cluster would receive: `pyflyte package` offline, then read the protobufs back."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import msgpack
import pytest
import yaml
from flyteidl.admin.launch_plan_pb2 import LaunchPlan
from flyteidl.admin.task_pb2 import TaskSpec
from flyteidl.admin.workflow_pb2 import WorkflowSpec
from flyteidl.core.execution_pb2 import WorkflowExecution
from flyteidl.core.tasks_pb2 import Resources
from flytekit.models.concurrency import ConcurrencyLimitBehavior
from google.protobuf.json_format import MessageToDict

from tests.conftest import REPO

BIN = Path(sys.executable).parent
IMAGE = "ghcr.io/acme/flyscale@sha256:" + "0" * 64


def _pyflyte_package(tmp_path: Path, image: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(BIN / "pyflyte"),
            "--pkgs",
            "workflows",
            "package",
            "--image",
            image,
            "-f",
            "-o",
            str(tmp_path / "pkg.tgz"),
        ],
        cwd=REPO,
        env={**os.environ, "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _package(tmp_path: Path, **env: str) -> dict[str, object]:
    """Every task's TaskSpec and every launch plan's LaunchPlan, by name, as `pyflyte package` wrote them."""
    proc = _pyflyte_package(tmp_path, IMAGE, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    specs: dict[str, object] = {}
    with tarfile.open(tmp_path / "pkg.tgz") as tar:
        for member in tar.getmembers():
            kind = member.name.rsplit("_", 1)[-1]  # flytekit's file names end in the entity's resource type
            if kind == "1.pb":
                spec = TaskSpec()
                spec.ParseFromString(tar.extractfile(member).read())
                specs[spec.template.id.name] = spec
            elif kind == "2.pb":
                workflow = WorkflowSpec()
                workflow.ParseFromString(tar.extractfile(member).read())
                specs[f"workflow {workflow.template.id.name}"] = workflow
            elif kind == "3.pb":
                plan = LaunchPlan()
                plan.ParseFromString(tar.extractfile(member).read())
                specs[f"launch plan {plan.id.name}"] = plan
    return specs


@pytest.fixture(scope="module")
def packaged(tmp_path_factory) -> dict[str, dict[str, object]]:
    """The workflow packaged for one node, and for three nodes of 4 GPU workers each."""
    gpus = tmp_path_factory.mktemp("resources") / "gpu-nodes.yaml"
    gpus.write_text(
        yaml.safe_dump(
            {
                "training": {
                    "cpu_per_process": "4",
                    "mem_per_process": "16Gi",
                    "gpu_per_process": 1,
                    "accelerator": "nvidia-h100",
                    "shared_memory": "8Gi",
                }
            }
        )
    )
    return {
        "one node": _package(tmp_path_factory.mktemp("one")),
        "three nodes": _package(
            tmp_path_factory.mktemp("three"),
            FLYSCALE_NNODES="3",
            FLYSCALE_NPROC_PER_NODE="4",
            FLYSCALE_RESOURCES=str(gpus),
        ),
    }


def _tasks(specs: dict[str, object]) -> dict[str, TaskSpec]:
    """The training pipeline's tasks (the scaling study's, tasks/scaling.py, batch prediction's,
    tasks/predict.py, and the search's, tasks/search.py, are their own)."""
    return {
        name: spec
        for name, spec in specs.items()
        if isinstance(spec, TaskSpec) and not name.startswith(("tasks.scaling.", "tasks.predict.", "tasks.search."))
    }


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_multi_node_training_serialises_as_pytorchjob(packaged):
    specs = packaged["three nodes"]
    train = specs["tasks.train.train_model"].template
    assert train.type == "pytorch"
    custom = MessageToDict(train.custom)
    assert custom["workerReplicas"]["replicas"] == 3
    assert custom["elasticConfig"]["nprocPerNode"] == 4
    assert custom["elasticConfig"]["minReplicas"] == custom["elasticConfig"]["maxReplicas"] == 3
    # the model check, the data branches (one a map task), both publish branches, the failure handler,
    # the data-only workflow's summary, and the content keying the search and the scaling study hand their splits through
    assert len(_tasks(specs)) == 22
    assert "tasks.register.close_failed_run" in specs
    # Batch prediction fans out: its scoring is an array node (a pod per piece on a cluster).
    assert any(n.startswith("tasks.predict.map_score_part") and n.endswith("-arraynode") for n in specs), sorted(specs)
    # The search: rounds of trials as a dynamic task (each trial the pipeline's training task, a
    # PyTorchJob on a cluster), then the best config through the training pipeline.
    search = {n for n in specs if n.startswith("tasks.search.")}
    assert {"tasks.search.run_trials", "tasks.search.tell_trials", "tasks.search.best_config"} <= search, search
    # A dead worker restarts the group once; a failed attempt is retried, and spot nodes are fine.
    assert custom["elasticConfig"]["maxRestarts"] == 1
    assert train.metadata.retries.retries == 2 and train.metadata.interruptible
    for name, spec in _tasks(specs).items():
        assert spec.template.container.image == IMAGE, name  # the digest-pinned image given to --image
    # Resources from the cluster file: a worker's share times the 4 workers of a node.
    resources = train.container.resources
    requests = {Resources.ResourceName.Name(r.name): r.value for r in resources.requests}
    assert requests == {"CPU": "16", "MEMORY": "64Gi", "GPU": "4"}
    assert {Resources.ResourceName.Name(r.name): r.value for r in resources.limits} == requests
    assert train.extended_resources.gpu_accelerator.device == "nvidia-h100"
    assert train.extended_resources.shared_memory.size_limit == "8Gi"
    # The pod's exit code follows the PyTorchJob convention: the wrapper runs flytekit's entrypoint.
    args = list(train.container.args)
    assert args[:4] == ["python", "-m", "flyscale.cluster.exit_codes", "pyflyte-execute"], args
    # Every other task asks for the file's (here default) small share.
    load = specs["tasks.examples.plan_shards"].template.container.resources
    assert {Resources.ResourceName.Name(r.name): r.value for r in load.requests} == {"CPU": "1", "MEMORY": "2Gi"}


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_typed_examples_are_prepared_by_a_map_task_over_their_shards(packaged):
    """On a cluster each shard of images or text is its own pod: an array node over the shard
    list, the config, the pinned info and the fingerprint bound, not mapped."""
    workflow = packaged["one node"]["workflow workflows.data.examples_data"]
    (array,) = [n.array_node for n in workflow.template.nodes if n.HasField("array_node")]
    assert array.node.task_node.reference_id.name.startswith("tasks.examples.map_prepare_shard_")
    shard = next(i.binding.promise for i in array.node.inputs if i.var == "shard")
    assert shard.attr_path[0].string_value == "shards"  # the plan's list of shards, mapped over
    assert set(array.bound_inputs) == {"cfg", "info", "fingerprint", "edges"}
    assert array.min_success_ratio == 1  # a shard that fails fails the preparation: nothing is dropped


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_the_nightly_launch_plan_is_scheduled_skips_overlaps_and_alerts(packaged):
    plan = packaged["one node"]["launch plan nightly_retraining"]
    assert plan.spec.entity_metadata.schedule.cron_schedule.schedule == "0 2 * * *"
    # Activation is flytekit's client-side flag, which `pyflyte register` acts on (not in the package).
    from collections import OrderedDict

    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    from workflows.launch_plans import nightly_retraining

    settings = SerializationSettings(image_config=ImageConfig.auto(img_name=IMAGE))
    assert get_serializable(OrderedDict(), settings, nightly_retraining).should_auto_activate
    assert plan.spec.concurrency_policy.max == 1
    assert plan.spec.concurrency_policy.behavior == ConcurrencyLimitBehavior.SKIP
    (alert,) = plan.spec.entity_metadata.notifications
    assert alert.email.recipients_email and WorkflowExecution.FAILED in alert.phases
    fixed = msgpack.unpackb(plan.spec.fixed_inputs.literals["cfg"].scalar.binary.value)  # flytekit's dataclass encoding
    assert fixed["data"]["options"]["path"] == "s3://flyscale-data/production/digits/"  # the production data, fixed


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_an_unpinned_image_is_refused_with_the_way_to_pin_it(tmp_path, monkeypatch):
    proc = _pyflyte_package(tmp_path, "ghcr.io/acme/flyscale:1.2")
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "'ghcr.io/acme/flyscale:1.2', which is not pinned by digest" in out, out[-3000:]
    assert "--image <registry>/flyscale@sha256:<digest>" in out and "FLYSCALE_ALLOW_UNPINNED_IMAGE=1" in out
    from flyscale.cluster.image import check_pinned

    monkeypatch.setenv("FLYSCALE_ALLOW_UNPINNED_IMAGE", "1")  # the development clusters' escape hatch
    check_pinned("ghcr.io/acme/flyscale:dev", "tasks.examples.plan_shards")


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_registered_cache_versions_carry_the_launcher(packaged):
    """What a cluster caches on: the training tasks' versions differ with the launcher, the others do not."""
    one = _tasks(packaged["one node"])
    version = {k: {n: s.template.metadata.discovery_version for n, s in _tasks(v).items()} for k, v in packaged.items()}
    changed = {n for n in version["one node"] if version["one node"][n] != version["three nodes"][n]}
    assert changed == {"tasks.train.train_model", "tasks.preflight.preflight_check"}
    cached = {n for n, s in one.items() if s.template.metadata.discoverable}
    always = {
        "tasks.preflight.check_model",
        "tasks.data.fingerprint_data",
        "tasks.data.read_reference",
        "tasks.evaluate.gate_model",
        "tasks.register.summarize",
        "tasks.data.summarize_data",  # prepare_data's summary: this execution's
        "tasks.register.close_failed_run",
        "tasks.data.by_content",  # reads nothing: the splits as handed in, re-keyed by content
    }  # the failure handler: it only ever closes this execution's run
    assert cached == set(one) - always


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_single_node_training_is_a_plain_pod(packaged):
    train = packaged["one node"]["tasks.train.train_model"].template
    assert train.type == "python-task"  # single-node elastic needs no training operator


@pytest.mark.timeout(240)
def test_multi_node_setting_run_locally_does_not_hang():
    from flytekit import task

    from flyscale.cluster.launchers import LocalSafeElastic

    @task(task_config=LocalSafeElastic(nnodes=2, nproc_per_node=2, monitor_interval=1))
    def two_nodes(n: int) -> int:
        return n + 1

    assert two_nodes(n=41) == 42


@pytest.mark.slow
def test_only_the_tasks_that_talk_to_mlflow_are_given_its_user(packaged):
    """The pipeline's MLflow user is a Flyte secret that registration, the gate and training
    request, mounted as files; a task that only moves data is not given it."""
    tasks = packaged["one node"]

    def secrets(name: str) -> set[tuple[str, str, int]]:
        security = tasks[name].template.security_context
        return {(s.group, s.key, int(s.mount_requirement)) for s in (security.secrets if security else [])}

    user = {("mlflow", "tracking_username", 2), ("mlflow", "tracking_password", 2)}  # 2: MountType.FILE
    for name in ("tasks.register.register_model", "tasks.evaluate.gate_model", "tasks.train.train_model"):
        assert secrets(name) == user, name
    for name in ("tasks.examples.plan_shards", "tasks.data.augment_data", "tasks.register.summarize"):
        assert not secrets(name), name
