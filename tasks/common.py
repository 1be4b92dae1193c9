"""What every flyscale task shares: the pinned image and resources, set at registration."""

from __future__ import annotations

import logging
import os
import re

import click
from flytekit import FlyteContextManager
from flytekit.core.python_auto_container import DefaultTaskResolver, get_registerable_container_image
from flytekit.deck import DeckField

from flyscale.distributed import DistContext, configure_logging
from flyscale.flyte_types import register_flyscale_types
from tasks import resources

log = logging.getLogger(__name__)

ALLOW_UNPINNED = "FLYSCALE_ALLOW_UNPINNED_IMAGE"
RUNNING_IMAGE = "FLYSCALE_IMAGE"  # set in the task's pod to the image it runs in (for the lineage tags)
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def registration_image() -> str | None:
    """The image the workflow is being registered with, while flytekit loads it: `--image` of
    `pyflyte package`/`pyflyte register` (flytekit loads the modules under those serialisation
    settings) or of `pyflyte run --remote` (its run parameters). None for a local run.

    Every task names it as its container image, so that it is part of their cache versions: a
    new image re-runs what it computes. There is one place to set it, flytekit's own `--image`.
    """
    settings = FlyteContextManager.current_context().serialization_settings
    if settings is not None and settings.image_config.default_image is not None:
        return settings.image_config.default_image.full
    run = getattr(click.get_current_context(silent=True), "obj", None)  # pyflyte run's RunLevelParams
    if getattr(run, "is_remote", False) and getattr(run, "image_config", None) is not None:
        return run.image_config.default_image.full
    return None


def check_pinned(image: str, task: str) -> None:
    """Refuse to register a task on an image named by a tag: a tag can move, a digest cannot."""
    if _DIGEST.search(image):
        return
    message = (
        f"task {task} would run on image {image!r}, which is not pinned by digest. Pin it: pass "
        f"--image <registry>/flyscale@sha256:<digest> to pyflyte register, pyflyte package or pyflyte run --remote "
        f"(`docker buildx imagetools inspect <registry>/flyscale:<tag>` prints the digest). On a development cluster, "
        f"{ALLOW_UNPINNED}=1 registers a tag anyway."
    )
    if os.environ.get(ALLOW_UNPINNED) == "1":
        log.warning("%s (allowed by %s=1)", message.split(". Pin it")[0], ALLOW_UNPINNED)
        return
    raise ValueError(message)


class PinnedImageResolver(DefaultTaskResolver):
    """flytekit's default task resolver, which also refuses an unpinned image as each task is
    serialised (for `pyflyte register`, `package` and `run --remote` alike), and tells the task's
    pod which image it runs in."""

    def loader_args(self, settings, task) -> list[str]:
        image = get_registerable_container_image(task.container_image, settings.image_config)
        check_pinned(image, task.name)
        return [*super().loader_args(settings, task), "image", image]

    def load_task(self, loader_args: list[str]):
        if len(loader_args) >= 6 and loader_args[4] == "image":
            os.environ.setdefault(RUNNING_IMAGE, loader_args[5])
        return super().load_task(loader_args[:4])


pinned_image_resolver = PinnedImageResolver()

# What every task is declared with: the registration's image, and the resolver that checks it.
IMAGE = registration_image()
TASK = {"container_image": IMAGE, "task_resolver": pinned_image_resolver}

SMALL = resources.SMALL  # every task but training (configs/cluster/resources.yaml)

# flytekit's default Decks of a task that publishes ours, less "Dependencies": a pip list of the
# image, which the lock pins already, and which costs about 1 s of every such task (3 a run).
DECKS = (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)

# Task processes log like rank 0: flyscale's loggers (and the plugins') at INFO. Their levels are
# set explicitly because importing mlflow.pytorch runs logging.basicConfig(level=ERROR), which
# would otherwise silence every warning a run gives after registration has started.
configure_logging(DistContext())

# Flyte describes each dataclass in a task interface by a JSON schema; build each one once.
register_flyscale_types()
