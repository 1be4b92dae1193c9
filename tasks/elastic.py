"""Which distributed launcher the training task uses, chosen at registration, never in code.

Locally (`pyflyte run` without --remote) training always runs as `nproc_per_node` torch-elastic
worker processes on this machine. On a cluster the same task becomes a Kubeflow PyTorchJob:

    FLYSCALE_NNODES=2 FLYSCALE_NPROC_PER_NODE=4 pyflyte run --remote workflows/train.py training_pipeline

or, with `FLYSCALE_LAUNCHER=pytorch`, a classic PyTorchJob of one master and
`FLYSCALE_NNODES - 1` worker pods (one process each) with per-replica resources
(`FLYSCALE_REPLICA_CPU`, `FLYSCALE_REPLICA_MEM`, `FLYSCALE_REPLICA_GPU`). Run locally, that
launcher trains in one process.

A multi-node setting run locally would wait for peers that never come (the rendezvous times out
after 15 minutes), so `LocalSafeElastic` runs it on one node instead and says so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from flytekit.core.task import TaskPlugins
from flytekit import Resources
from flytekitplugins.kfpytorch import Elastic, Master, PyTorch, Worker
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

log = logging.getLogger(__name__)


@dataclass
class LocalSafeElastic(Elastic):
    """`Elastic`, except that a local run with nnodes > 1 falls back to one node."""


class LocalSafeElasticTask(PytorchElasticFunctionTask):
    def _execute(self, **kwargs):
        # The training operator sets PET_NNODES in every PyTorchJob pod; without it we are local.
        in_pytorchjob = os.environ.get("PET_NNODES") is not None
        if self.min_nodes > 1 and not in_pytorchjob:
            log.warning(
                "nnodes=%s applies to remote runs only; running locally on one node with %d workers",
                self.task_config.nnodes, self.task_config.nproc_per_node,
            )
            saved = (self.min_nodes, self.max_nodes)
            self.min_nodes = self.max_nodes = 1
            try:
                return super()._execute(**kwargs)
            finally:
                self.min_nodes, self.max_nodes = saved
        return super()._execute(**kwargs)


TaskPlugins.register_pythontask_plugin(LocalSafeElastic, LocalSafeElasticTask)


def _replica_resources() -> Resources:
    gpu = os.environ.get("FLYSCALE_REPLICA_GPU")
    return Resources(
        cpu=os.environ.get("FLYSCALE_REPLICA_CPU", "2"), mem=os.environ.get("FLYSCALE_REPLICA_MEM", "4Gi"), gpu=gpu or None
    )


def training_launcher() -> LocalSafeElastic | PyTorch:
    """The launcher from FLYSCALE_LAUNCHER (elastic | pytorch), FLYSCALE_NNODES, FLYSCALE_NPROC_PER_NODE.

    Defaults: elastic, 1 node, 2 worker processes.
    """
    launcher = os.environ.get("FLYSCALE_LAUNCHER", "elastic")
    nnodes = int(os.environ.get("FLYSCALE_NNODES", "1"))
    nproc = int(os.environ.get("FLYSCALE_NPROC_PER_NODE", "2"))
    if nnodes < 1 or nproc < 1:
        raise ValueError(f"FLYSCALE_NNODES and FLYSCALE_NPROC_PER_NODE must be >= 1, got {nnodes} and {nproc}")
    if launcher == "pytorch":
        if nnodes < 2:
            raise ValueError("FLYSCALE_LAUNCHER=pytorch needs FLYSCALE_NNODES >= 2 (one master plus workers)")
        resources = _replica_resources()
        return PyTorch(
            master=Master(requests=resources, limits=resources),
            worker=Worker(replicas=nnodes - 1, requests=resources, limits=resources),
            increase_shared_mem=False,
        )
    if launcher != "elastic":
        raise ValueError(f"FLYSCALE_LAUNCHER must be 'elastic' or 'pytorch', got {launcher!r}")
    # Short rendezvous timeouts locally; a cluster may wait for pods to be scheduled.
    timeouts = {"timeout": 900, "join_timeout": 900} if nnodes > 1 else {"timeout": 120, "join_timeout": 120}
    return LocalSafeElastic(
        nnodes=nnodes, nproc_per_node=nproc, rdzv_configs=timeouts, monitor_interval=1,
        increase_shared_mem=False,  # the task asks for shared memory itself (@task(shared_memory=True))
    )
