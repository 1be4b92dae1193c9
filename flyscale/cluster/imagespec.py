"""The flyscale task image as a flytekit `ImageSpec`, for teams that build images with flytekit.

The Dockerfile stays the reference build; this spec is built from the same two facts, read from
the same files, so the two cannot drift: the base image pinned by digest (the Dockerfile's
`ARG BASE_IMAGE`) and the exact pins of a lock file (`requirements.lock`, or
`requirements-cuda.lock` for GPUs). No task uses it: opt in where you define tasks, e.g.

    from flyscale.cluster.imagespec import flyscale_image_spec
    image = flyscale_image_spec(registry="ghcr.io/acme")
    # @task(container_image=image) ... or pyflyte run --remote --image "$(python -c ...)"

The image is then built by flytekit's default builder (Docker with BuildKit) when a workflow
that uses it is registered.
"""

from __future__ import annotations

import re
from pathlib import Path

from flytekit import ImageSpec

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
LOCKS = {"cpu": "requirements.lock", "cuda": "requirements-cuda.lock"}
# What the Dockerfile's runtime stage copies into /root, the working directory and PYTHONPATH.
PROJECT_FILES = ["pyproject.toml", "README.md", "flyscale", "plugins", "tasks", "workflows", "configs"]
# Also copied, so that this module, imported again inside the image, rebuilds the same spec.
SPEC_INPUTS = ["Dockerfile"]
# The base image's own interpreter: without it flytekit's builder would install a second Python
# with micromamba. With it, the builder makes a venv in /root/.venv and installs the lock there.
BASE_PYTHON = "/usr/local/bin/python"


def dockerfile_arg(name: str, dockerfile: Path | None = None) -> str:
    """The default value of `ARG <name>=...` in the Dockerfile."""
    dockerfile = dockerfile or DOCKERFILE
    match = re.search(rf"^ARG\s+{re.escape(name)}=(\S*)\s*$", dockerfile.read_text(), re.M)
    if match is None:
        raise ValueError(f"{dockerfile} has no `ARG {name}=<default>` line")
    return match.group(1)


def flyscale_image_spec(registry: str | None = None, *, variant: str = "cpu", name: str = "flyscale") -> ImageSpec:
    """An ImageSpec of the flyscale image: the Dockerfile's pinned base, a lock, the project installed.

    registry: where flytekit pushes the image (e.g. "ghcr.io/acme"); None keeps it local.
    variant: "cpu" (requirements.lock: torch==X+cpu from the CPU index the Dockerfile names in
        `ARG TORCH_INDEX`) or "cuda" (requirements-cuda.lock: PyPI's CUDA torch and its nvidia-*
        wheels; GPU nodes need only the NVIDIA driver and device plugin).

    The project is copied into /root and installed editable with `--no-deps`, as in the
    Dockerfile, so the plugins' entry points resolve and fast registration replaces the code.
    Call it from the project root (inside the image that is /root, the working directory):
    flytekit reads `requirements` and `copy` relative to the working directory, and relative
    paths keep the spec's id the same where it was registered and where it runs. The
    container runs as flytekit's non-root `flytekit` user.
    """
    if variant not in LOCKS:
        raise ValueError(f"variant must be one of {sorted(LOCKS)}, got {variant!r}")
    if Path.cwd().resolve() != ROOT:
        raise ValueError(
            f"call flyscale_image_spec() from the project root {ROOT}: flytekit copies "
            f"{PROJECT_FILES} from the working directory, which is {Path.cwd()}"
        )
    base_image = dockerfile_arg("BASE_IMAGE")
    if "@sha256:" not in base_image:
        raise ValueError(f"the Dockerfile's BASE_IMAGE {base_image!r} is not pinned by digest")
    env = {"PYTHONUNBUFFERED": "1"}
    extra_index = []
    if variant == "cpu":
        extra_index = [dockerfile_arg("TORCH_INDEX")]
        # uv takes a package from the first index that has its name; the torch index also serves
        # numpy, pillow, ... in other versions than the lock's. Let every index compete.
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return ImageSpec(
        name=name if variant == "cpu" else f"{name}-{variant}",
        registry=registry,
        builder="default",
        platform="linux/amd64",
        base_image=base_image,
        python_exec=BASE_PYTHON,
        requirements=LOCKS[variant],
        pip_extra_index_url=extra_index or None,
        env=env,
        copy=[*SPEC_INPUTS, LOCKS[variant], *PROJECT_FILES],
        # setuptools comes from the lock, hence no build isolation (and no second download).
        commands=["uv pip install --no-deps --no-build-isolation -e /root"],
    )
