"""What a cluster would receive: `pyflyte package` offline, then read the protobufs back."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from flyteidl.admin.task_pb2 import TaskSpec
from google.protobuf.json_format import MessageToDict

from tests.conftest import REPO

BIN = Path(sys.executable).parent
IMAGE = "ghcr.io/acme/flyscale@sha256:" + "0" * 64


def _package(tmp_path: Path, **env: str) -> dict[str, TaskSpec]:
    out = tmp_path / "pkg.tgz"
    proc = subprocess.run(
        [str(BIN / "pyflyte"), "--pkgs", "workflows", "package", "--image", "unused:1", "-f", "-o", str(out)],
        cwd=REPO, env={**os.environ, "HOME": str(tmp_path), "FLYSCALE_IMAGE": IMAGE, **env},
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    specs = {}
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            if member.name.split("_", 1)[-1].startswith("tasks."):
                spec = TaskSpec()
                spec.ParseFromString(tar.extractfile(member).read())
                specs[spec.template.id.name] = spec
    return specs


@pytest.fixture(scope="module")
def packaged(tmp_path_factory) -> dict[str, dict[str, TaskSpec]]:
    """The workflow packaged for one node and for three."""
    return {
        "one node": _package(tmp_path_factory.mktemp("one")),
        "three nodes": _package(tmp_path_factory.mktemp("three"), FLYSCALE_NNODES="3", FLYSCALE_NPROC_PER_NODE="4"),
    }


@pytest.mark.timeout(400)
def test_multi_node_training_serialises_as_pytorchjob(packaged):
    specs = packaged["three nodes"]
    train = specs["tasks.train.train_model"].template
    assert train.type == "pytorch"
    custom = MessageToDict(train.custom)
    assert custom["workerReplicas"]["replicas"] == 3
    assert custom["elasticConfig"]["nprocPerNode"] == 4
    assert custom["elasticConfig"]["minReplicas"] == custom["elasticConfig"]["maxReplicas"] == 3
    assert len(specs) == 16  # both data branches, both publish branches, and the failure handler
    assert "tasks.register.close_failed_run" in specs
    # A dead worker restarts the group once; a failed attempt is retried, and spot nodes are fine.
    assert custom["elasticConfig"]["maxRestarts"] == 1
    assert train.metadata.retries.retries == 2 and train.metadata.interruptible
    for name, spec in specs.items():
        assert spec.template.container.image == IMAGE, name  # the digest-pinned image from FLYSCALE_IMAGE


@pytest.mark.timeout(400)
def test_registered_cache_versions_carry_the_launcher(packaged):
    """What a cluster caches on: the training tasks' versions differ with the launcher, the others do not."""
    one = packaged["one node"]
    version = {k: {n: s.template.metadata.discovery_version for n, s in v.items()} for k, v in packaged.items()}
    changed = {n for n in version["one node"] if version["one node"][n] != version["three nodes"][n]}
    assert changed == {"tasks.train.train_model", "tasks.preflight.preflight_check"}
    cached = {n for n, s in one.items() if s.template.metadata.discoverable}
    always = {"tasks.data.fingerprint_data", "tasks.data.read_reference", "tasks.evaluate.gate_model", "tasks.register.summarize",
              "tasks.register.close_failed_run"}  # the failure handler: it only ever closes this execution's run
    assert cached == set(one) - always


@pytest.mark.timeout(400)
def test_single_node_training_is_a_plain_pod(packaged):
    train = packaged["one node"]["tasks.train.train_model"].template
    assert train.type == "python-task"  # single-node elastic needs no training operator


@pytest.mark.timeout(240)
def test_multi_node_setting_run_locally_does_not_hang():
    from flytekit import task

    from tasks.elastic import LocalSafeElastic

    @task(task_config=LocalSafeElastic(nnodes=2, nproc_per_node=2, monitor_interval=1))
    def two_nodes(n: int) -> int:
        return n + 1

    assert two_nodes(n=41) == 42
