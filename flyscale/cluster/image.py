"""The image every task runs on: the one given to flytekit's `--image` at registration, pinned
by digest (a tag can move, a digest cannot), and named in every task's pod environment for the
lineage tags."""

from __future__ import annotations

import logging
import re

import click
from flytekit import FlyteContextManager
from flytekit.core.python_auto_container import (
    DefaultTaskResolver,
    get_registerable_container_image,
)

from flyscale import settings

log = logging.getLogger(__name__)

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def registration_image() -> str | None:
    """The image the workflow is being registered with, while flytekit loads it: `--image` of
    `pyflyte package`/`pyflyte register` (flytekit loads the modules under those serialisation
    settings) or of `pyflyte run --remote` (its run parameters). None for a local run.

    Every task names it as its container image, so that it is part of their cache versions: a
    new image re-runs what it computes. There is one place to set it, flytekit's own `--image`.
    """
    serialization = FlyteContextManager.current_context().serialization_settings
    if serialization is not None and serialization.image_config.default_image is not None:
        return serialization.image_config.default_image.full
    run = getattr(click.get_current_context(silent=True), "obj", None)  # pyflyte run's RunLevelParams
    image_config = getattr(run, "image_config", None)
    if getattr(run, "is_remote", False) and image_config is not None:
        return image_config.default_image.full
    return None


def check_pinned(image: str, task: str) -> None:
    """Refuse to register a task on an image named by a tag: a tag can move, a digest cannot."""
    if _DIGEST.search(image):
        return
    allow = settings.ALLOW_UNPINNED_IMAGE.name
    message = (
        f"task {task} would run on image {image!r}, which is not pinned by digest. Pin it: pass "
        f"--image <registry>/flyscale@sha256:<digest> to pyflyte register, pyflyte package or pyflyte run --remote "
        f"(`docker buildx imagetools inspect <registry>/flyscale:<tag>` prints the digest). On a development cluster, "
        f"{allow}=1 registers a tag anyway."
    )
    if settings.ALLOW_UNPINNED_IMAGE.get() == "1":
        log.warning("%s (allowed by %s=1)", message.split(". Pin it")[0], allow)
        return
    raise ValueError(message)


class PinnedImageResolver(DefaultTaskResolver):
    """flytekit's default task resolver, which also refuses an unpinned image as each task is
    serialised (for `pyflyte register`, `package` and `run --remote` alike)."""

    def loader_args(self, settings, task) -> list[str]:
        image = get_registerable_container_image(task.container_image, settings.image_config)
        check_pinned(image, task.name)
        return super().loader_args(settings, task)


pinned_image_resolver = PinnedImageResolver()
