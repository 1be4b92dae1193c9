"""What every flyscale task shares: the pinned image and resources, set at registration."""

from __future__ import annotations

import os

from flytekit import Resources

# The image every task runs in on a cluster. Pin it by digest when registering:
#   FLYSCALE_IMAGE=ghcr.io/acme/flyscale@sha256:... pyflyte register workflows/
IMAGE = os.environ.get("FLYSCALE_IMAGE", "ghcr.io/flyscale/flyscale:0.1.0")

SMALL = Resources(cpu="1", mem="2Gi")
