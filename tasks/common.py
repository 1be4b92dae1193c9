"""What every flyscale task shares: the pinned image and resources, set at registration."""

from __future__ import annotations

import os

from flytekit import Resources
from flytekit.deck import DeckField

from flyscale.distributed import DistContext, configure_logging
from flyscale.flyte_types import register_flyscale_types

# The image every task runs in on a cluster. Pin it by digest when registering:
#   FLYSCALE_IMAGE=ghcr.io/acme/flyscale@sha256:... pyflyte register workflows/
IMAGE = os.environ.get("FLYSCALE_IMAGE", "ghcr.io/flyscale/flyscale:0.1.0")

SMALL = Resources(cpu="1", mem="2Gi")

# flytekit's default Decks of a task that publishes ours, less "Dependencies": a pip list of the
# image, which the lock pins already, and which costs about 1 s of every such task (3 a run).
DECKS = (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)

# Task processes log like rank 0: flyscale's loggers (and the plugins') at INFO. Their levels are
# set explicitly because importing mlflow.pytorch runs logging.basicConfig(level=ERROR), which
# would otherwise silence every warning a run gives after registration has started.
configure_logging(DistContext())

# Flyte describes each dataclass in a task interface by a JSON schema; build each one once.
register_flyscale_types()
