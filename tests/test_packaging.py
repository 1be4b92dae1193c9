"""What `pip install` and the image get: two import packages, and tasks that run from the image
under both kinds of Flyte registration.

The wheel installs `flyscale` (the core) and `flyscale_plugins` (the built-ins, from plugins/ by a
package-dir mapping) and no generic top-level name. tasks/ and workflows/ are project code: the
image carries the project in its working directory, installed there in editable mode, so that
fast registration (which unpacks fresh code over that directory) refreshes core, built-ins and
tasks alike. Docker is not available here, so `image` below builds the same layout as the
Dockerfile's runtime stage in a scratch venv, and the tasks run through the entrypoint a cluster
would call (`pyflyte-execute`, `pyflyte-fast-execute`), with the args `pyflyte package` wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from flyteidl.admin.task_pb2 import TaskSpec
from flyteidl.core.literals_pb2 import LiteralMap as LiteralMapPb

from tests.conftest import REPO

BIN = Path(sys.executable).parent
# What the image's COPY instructions take (the .dockerignore allowlist, less the lock).
PROJECT = ["pyproject.toml", "README.md", "flyscale", "plugins", "tasks", "workflows", "configs", ".dockerignore"]


def _copy_project(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in PROJECT:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd[:3]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = _copy_project(root / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root), str(src)])
    (found,) = root.glob("flyscale-*.whl")
    return found


def test_the_wheel_installs_no_generic_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode()
    top = {n.split("/")[0] for n in names} - {dist_info}
    assert top == {"flyscale", "flyscale_plugins"}
    assert "flyscale_plugins/strategies/ddp.py" in names and "flyscale/plugin/registry.py" in names
    # Every built-in's entry point names the installed package, never the folder it lives in.
    values = [line.split("=", 1)[1].strip() for line in entry_points.splitlines() if "=" in line]
    assert values and all(v.startswith(("flyscale_plugins.", "flyscale.cli:")) for v in values), values


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_installed_wheel_works_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)])
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = (
        "import flyscale, flyscale_plugins, importlib.util as u\n"
        "print(flyscale_plugins.__file__)\n"
        "print([n for n in ('plugins', 'tasks', 'workflows') if u.find_spec(n)])\n"
    )
    out = _run([sys.executable, "-c", probe], cwd=tmp_path, env=env).stdout.splitlines()
    assert out[0].startswith(str(site))  # the built-ins come from the wheel, not from the checkout
    assert out[1] == "[]"  # and the generic names are nowhere to be imported
    listing = _run([sys.executable, "-m", "flyscale.cli", "plugins"], cwd=tmp_path, env=env).stdout
    assert "datasets       digits" in listing and listing.rstrip().endswith(", 0 broken"), listing


@pytest.mark.slow
def test_flyscale_plugins_runs_from_any_directory(tmp_path):
    """The console script, as a user with the venv active types it, from outside the checkout."""
    proc = _run([str(BIN / "flyscale"), "plugins", "--kind", "models"], cwd=tmp_path)
    assert "flyscale_plugins.models:mlp" in proc.stdout and proc.stdout.rstrip().endswith("0 broken"), proc.stdout


# --- the image, without Docker ----------------------------------------------------------------


@pytest.fixture
def image(tmp_path_factory) -> tuple[Path, Path]:  # per test: fast registration writes into WORKDIR
    """(venv bin dir, WORKDIR) laid out as the Dockerfile's runtime stage lays out the image.

    The locked dependencies come from this test venv (through a .pth file) instead of being
    installed again; the project is copied into WORKDIR and installed there in editable mode.
    """
    root = tmp_path_factory.mktemp("image")
    venv, workdir = root / "venv", _copy_project(root / "workdir")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    (site / "_locked_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(workdir),
        ]
    )
    for script, fn in (("pyflyte-execute", "execute_task_cmd"), ("pyflyte-fast-execute", "fast_execute_task_cmd")):
        path = venv / "bin" / script
        path.write_text(f"#!{venv / 'bin' / 'python'}\nfrom flytekit.bin.entrypoint import {fn}\n{fn}()\n")
        path.chmod(0o755)
    return venv / "bin", workdir


def _package(project: Path, out: Path, *flags: str) -> dict[str, TaskSpec]:
    _run(
        [
            str(BIN / "pyflyte"),
            "--pkgs",
            "workflows",
            "package",
            "--image",
            "ghcr.io/acme/flyscale@sha256:" + "0" * 64,
            *flags,
            "-f",
            "-o",
            str(out),
        ],
        cwd=project,
        env={**os.environ, "HOME": str(out.parent)},
    )
    specs = {}
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".pb") and "_tasks." in member.name:
                spec = TaskSpec()
                spec.ParseFromString(tar.extractfile(member).read())
                specs[spec.template.id.name] = spec
            elif member.name.startswith("fast") and member.name.endswith(".tar.gz"):
                tar.extract(member, out.parent)
    return specs


def _plan_inputs(path: Path) -> Path:
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from flyscale.config import DataConfig
    from flyscale.data import source as data
    from flyscale.data.reference import Reference
    from flyscale.data.source import DataFingerprint

    cfg = DataConfig()
    literals = TypeEngine.dict_to_literal_map(
        FlyteContextManager.current_context(),
        {"cfg": cfg, "fingerprint": data.fingerprint(cfg), "reference": Reference()},
        {"cfg": DataConfig, "fingerprint": DataFingerprint, "reference": Reference},
    )
    path.write_bytes(literals.to_flyte_idl().SerializeToString())
    return path


def _execute(image: tuple[Path, Path], args: list[str], scratch: Path, fast_tarball: Path | None = None):
    """Run plan_shards' serialised container args in the image; returns the DatasetInfo it planned with."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import LiteralMap

    from tasks.examples import ShardPlan

    bin_dir, workdir = image
    out = scratch / "outputs"
    values = {
        "{{.input}}": str(_plan_inputs(scratch / "inputs.pb")),
        "{{.outputPrefix}}": str(out),
        "{{.rawOutputDataPrefix}}": str(scratch / "raw"),
        "{{.checkpointOutputPrefix}}": str(scratch / "ckpt"),
        "{{.prevCheckpointPrefix}}": "",
        "{{ .remote_package_path }}": str(fast_tarball),
        "/root": str(workdir),
    }
    cmd = [values.get(a, a) for a in args]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(workdir)}
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and (out / "outputs.pb").exists(), (
        f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    )
    pb = LiteralMapPb()
    pb.ParseFromString((out / "outputs.pb").read_bytes())
    literal = LiteralMap.from_flyte_idl(pb).literals["o0"]
    return TypeEngine.to_python_value(FlyteContextManager.current_context(), literal, ShardPlan).info


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_a_task_runs_in_the_image_without_fast_registration(image, tmp_path):
    specs = _package(REPO, tmp_path / "pkg.tgz")
    args = list(specs["tasks.examples.plan_shards"].template.container.args)
    assert args[0] == "pyflyte-execute" and "tasks.examples" in args  # the image's own copy of the code
    info = _execute(image, args, tmp_path)
    assert info.name == "digits" and info.num_classes == 10


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_fast_registration_refreshes_core_built_ins_and_tasks_together(image, tmp_path):
    """New code in the fast-registered tarball replaces the image's, built-in plugins included
    (an installed copy of them beside fresh core code would be a version skew)."""
    changed = _copy_project(tmp_path / "changed")
    datasets = changed / "plugins" / "datasets.py"
    datasets.write_text(datasets.read_text().replace('name="digits"', 'name="digits, fast-registered"'))
    specs = _package(changed, tmp_path / "pkg.tgz", "--fast")
    args = list(specs["tasks.examples.plan_shards"].template.container.args)
    assert args[0] == "pyflyte-fast-execute" and args[args.index("--dest-dir") + 1] == "/root"
    (tarball,) = tmp_path.glob("fast*.tar.gz")
    info = _execute(image, args, tmp_path, fast_tarball=tarball)
    assert info.name == "digits, fast-registered"


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_lock_installs_from_the_public_index_alone(tmp_path):
    """What `make install` asks of a user's machine: every pin of requirements.lock resolves on
    PyPI with pip's own defaults (no configuration file, no local wheel folder). torch is pinned
    without a local version: `==2.13.0` takes PyPI's wheel there, and a local CPU build where pip
    is configured to find one (2.13.0+cpu satisfies it)."""
    pins = [line for line in (REPO / "requirements.lock").read_text().splitlines() if "==" in line]
    assert [p for p in pins if "+" in p] == [], "a local version is on no public index"
    assert not [p for p in pins if p.startswith("nvidia-")], "the CPU lock must not pull CUDA wheels"
    public = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,  # pip then reads no configuration file at all
        **{k: "" for k in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT")},
    }
    report = tmp_path / "report.json"
    _run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        + ["--report", str(report), "-r", str(REPO / "requirements.lock")],
        env=public,
    )
    chosen = {i["metadata"]["name"].lower(): i for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"]["metadata"]["version"] == "2.13.0"
    assert chosen["torch"]["download_info"]["url"].startswith("https://files.pythonhosted.org/")
    assert f"mlflow=={chosen['mlflow']['metadata']['version']}" in pins
