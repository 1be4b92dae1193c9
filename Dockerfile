# syntax=docker/dockerfile:1.7
# The image every flyscale Flyte task runs in (locally built, pushed, then passed
# to `pyflyte run --remote --image ...` / `pyflyte register --image ...`).
#
# CPU build (default): requirements.lock pins torch==2.13.0 (compiled against the CPU build: no
# nvidia-* wheels); the CPU index below serves 2.13.0+cpu, which satisfies that pin and wins.
#   docker build -t <registry>/flyscale:<tag> .
# GPU build: requirements-cuda.lock (`make lock-cuda`) pins PyPI's torch==2.13.0, the CUDA 13
# build, whose CUDA libraries come as nvidia-* wheels: no CUDA base image is needed, only GPU
# nodes with an NVIDIA driver recent enough for CUDA 13 and the NVIDIA device plugin.
# TORCH_INDEX must be empty for it: the CPU index's 2.13.0+cpu also satisfies ==2.13.0 and
# would win (a local version sorts above the plain one).
#   docker build --build-arg LOCK_FILE=requirements-cuda.lock --build-arg TORCH_INDEX= \
#                -t <registry>/flyscale:<tag>-cuda .
#
# Base image, pinned by digest: the multi-arch manifest list of python:3.11.16-slim-bookworm,
# as published in docker-library/repo-info, repos/python/remote/3.11.16-slim-bookworm.md
# ("$ docker pull python@sha256:..." at the top of that file). The tag is for the reader;
# the digest is what Docker pulls. To move to a newer build, take the new digest from that
# file (or `docker buildx imagetools inspect python:<tag>`) and change the line below;
# flyscale/cluster/imagespec.py reads it from here.
ARG BASE_IMAGE=python:3.11.16-slim-bookworm@sha256:c425d915a89a6dcd3183b1797ad9bd8878caff5a417f6371c8df93c8ea8b727f

# ---------------------------------------------------------------------------
# builder: resolve nothing, install exact pins into a venv we copy out whole.
# ---------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

# Where torch's wheels live besides PyPI. The CPU index serves torch==2.13.0+cpu (no nvidia-*
# wheels); leave it empty for the CUDA lock, whose torch comes from PyPI.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Exact pins made by `make lock` (uv pip compile); pip never backtracks over them.
ARG LOCK_FILE=requirements.lock

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv "${VIRTUAL_ENV}"

# The lock goes in alone, so that code edits do not re-install 2 GB of wheels.
COPY ${LOCK_FILE} /tmp/requirements.lock
RUN pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "${TORCH_INDEX}"} \
    -r /tmp/requirements.lock

# ---------------------------------------------------------------------------
# runtime: the base image, the venv, the project, a non-root user. No compilers.
# ---------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

LABEL org.opencontainers.image.title="flyscale" \
      org.opencontainers.image.description="flyscale training-pipeline tasks for Flyte" \
      org.opencontainers.image.licenses="Apache-2.0"

# PYTHONUNBUFFERED: task logs reach `kubectl logs` / the Flyte console as they happen.
# OMP_NUM_THREADS is deliberately NOT set: flytekit's Elastic launcher sets it per
# worker (nproc_per_node), and an image-wide value would override that split.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid lets Kubernetes verify `runAsNonRoot: true` against the image.
# /root is handed to that user: it is the working directory (see WORKDIR below).
RUN groupadd --gid 1000 flyscale \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash flyscale \
    && chown flyscale:flyscale /root

COPY --from=builder /opt/venv /opt/venv

# The project lives in the working directory, installed there in editable mode: `flyscale` and
# `flyscale_plugins` (plugins/, by the package-dir mapping) resolve to these files, and tasks/
# and workflows/ (project code, never installed) import from here through PYTHONPATH.
# flytekit's fast registration ships the working tree as a tarball and unpacks it into the
# task's destination dir: `pyflyte register` defaults to /root and `pyflyte run --remote` to
# "." (the WORKDIR). Unpacked over these same files, fresh core, built-in plugins and tasks
# replace the image's together (an installed, non-editable copy of the built-ins would stay
# stale beside fresh core code). New entry points still need a rebuilt image.
WORKDIR /root
ENV PYTHONPATH=/root
COPY --chown=1000:1000 pyproject.toml README.md ./
COPY --chown=1000:1000 flyscale ./flyscale
COPY --chown=1000:1000 plugins ./plugins
COPY --chown=1000:1000 tasks ./tasks
COPY --chown=1000:1000 workflows ./workflows
# The registration-time files: cluster resources, the nightly run's inputs, the presets.
COPY --chown=1000:1000 configs ./configs
# Dependencies are already pinned above: --no-deps keeps pip from re-resolving, and
# --no-build-isolation builds with the lock's setuptools instead of fetching another.
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
    && chown -R flyscale:flyscale /root

USER 1000:1000
