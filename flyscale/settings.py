"""Every FLYSCALE_* environment variable, in one place: its name, its default and what it means.

Config that describes a run lives in the typed config (`--cfg`). These variables are for what
cannot be a workflow input: how the graph is built when a workflow is registered (the launcher,
the processes per node, the resources), what the registered nightly run gets, facts of the
machine a pod runs on (the image, the commit), and local conveniences. flyscale reads them only
through `Setting.get` here (a test holds the code to that), and docs/configuration.md lists them.

`when` says when a value is read: `registration` (flytekit loading the workflow for `pyflyte
run`, `register` or `package`: it shapes the tasks that are registered), `run` (while a task
runs), or `pod` (set in the task's container by the image or the cluster).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One environment variable flyscale reads."""

    name: str
    default: str
    meaning: str
    when: str = "registration"

    def get(self) -> str:
        """The value set in the environment, or the default (an empty value counts as unset)."""
        return os.environ.get(self.name) or self.default

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))

    def integer(self, minimum: int) -> int:
        """The value as an integer >= `minimum`; a ValueError naming the variable otherwise."""
        text = self.get()
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{self.name} must be a whole number, got {text!r}") from None
        if value < minimum:
            raise ValueError(f"{self.name} must be >= {minimum}, got {value}")
        return value


LAUNCHER = Setting(
    "FLYSCALE_LAUNCHER",
    "elastic",
    "how training workers start: `elastic` (torch-elastic: local processes, or a PyTorchJob of "
    "elastic pods) or `pytorch` (a classic PyTorchJob of one master and worker pods)",
)
NNODES = Setting(
    "FLYSCALE_NNODES",
    "1",
    "nodes (pods) of the training job on a cluster, or a range MIN:MAX (elastic: it trains on as few as MIN); "
    "a local run uses one",
)
NPROC_PER_NODE = Setting(
    "FLYSCALE_NPROC_PER_NODE",
    "auto",
    "training worker processes per node: a number, or `auto`: locally, the preflight times one process "
    "against 2 workers on the real model and batch and training takes the faster (the global batch kept); "
    "on a cluster, 2",
)
MAX_RESTARTS = Setting(
    "FLYSCALE_MAX_RESTARTS",
    "1",
    "how often torch-elastic restarts the worker group after a worker dies (it resumes from the last checkpoint)",
)
TRAIN_RETRIES = Setting(
    "FLYSCALE_TRAIN_RETRIES",
    "2",
    "how often Flyte retries the training task after a retryable failure (each retry resumes from the last checkpoint)",
)
RESOURCES = Setting(
    "FLYSCALE_RESOURCES",
    "configs/cluster/resources.yaml",
    "the file of what each stage asks the cluster for (CPU, memory, GPUs per training process)",
)
ALLOW_UNPINNED_IMAGE = Setting(
    "FLYSCALE_ALLOW_UNPINNED_IMAGE",
    "",
    "`1` registers tasks on an image named by a tag, not a digest (development clusters only)",
)
PRODUCTION_CONFIG = Setting(
    "FLYSCALE_PRODUCTION_CONFIG",
    "configs/cluster/production.yaml",
    "the pipeline config the nightly retraining launch plan gets as fixed inputs",
)
NIGHTLY_CRON = Setting("FLYSCALE_NIGHTLY_CRON", "0 2 * * *", "when the nightly retraining runs (cron, UTC)")
ALERT_EMAILS = Setting(
    "FLYSCALE_ALERT_EMAILS", "ml-platform@example.com", "who hears of a failed nightly run (comma-separated addresses)"
)
IMAGE = Setting(
    "FLYSCALE_IMAGE",
    "",
    "the image a task's pod runs in, set by flyscale in every task's environment at registration; "
    "recorded as the `flyscale.image` tag of a registered model",
    "pod",
)
GIT_COMMIT = Setting(
    "FLYSCALE_GIT_COMMIT",
    "",
    "the commit the code came from (set in the image); unset: asked of the checkout's git",
    "pod",
)
CACHE_DIR = Setting(
    "FLYSCALE_CACHE_DIR",
    "",
    "where answers that depend only on the code are kept between processes (import graphs, "
    "Flyte type schemas); unset: $XDG_CACHE_HOME/flyscale or ~/.cache/flyscale",
    "run",
)
EXIT_CODE_FILE = Setting(
    "FLYSCALE_EXIT_CODE_FILE",
    "",
    "set by the training pod's exit-code wrapper for the task it runs: where the task records how it failed",
    "pod",
)
INTERRUPT_NOTE = Setting(
    "FLYSCALE_INTERRUPT_NOTE",
    "",
    "set by a local run for its training workers: the file where rank 0 notes the step a Ctrl-C stopped "
    "training at, for the run to say as it exits",
    "run",
)
VERBOSE = Setting(
    "FLYSCALE_VERBOSE",
    "",
    "`1` shows the whole traceback of a bad-config or bad-data error, not only its message",
    "run",
)

ALL: tuple[Setting, ...] = (
    LAUNCHER,
    NNODES,
    NPROC_PER_NODE,
    MAX_RESTARTS,
    TRAIN_RETRIES,
    RESOURCES,
    ALLOW_UNPINNED_IMAGE,
    PRODUCTION_CONFIG,
    NIGHTLY_CRON,
    ALERT_EMAILS,
    IMAGE,
    GIT_COMMIT,
    CACHE_DIR,
    EXIT_CODE_FILE,
    INTERRUPT_NOTE,
    VERBOSE,
)
