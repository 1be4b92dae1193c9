"""Cache versions follow the facts: the real tasks' versions, read from a fresh import of the
workflow, change exactly when something that changes their result changes, and not otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flyscale.flyte.caching import module_closure, source_hash
from tests.conftest import REPO

TASKS = [
    "augment_data",
    "plan_shards",
    "prepare_shard",
    "combine_shards",
    "tokenize_text",
    "preflight_check",
    "train_model",
    "evaluate_model",
    "export_model",
    "load_test_model",
    "quantize_model",
    "register_model",
    "record_candidate",
]
VERSIONS = """
import contextlib, json, os
from flytekit import FlyteContextManager
from flytekit.configuration import ImageConfig, SerializationSettings
from tests.flyte_graph import workflow_tasks
# REGISTER_IMAGE: loaded as `pyflyte register --image` loads the workflow (under serialisation settings)
image = os.environ.get("REGISTER_IMAGE")
ctx = FlyteContextManager.current_context()
loading = FlyteContextManager.with_context(ctx.with_serialization_settings(SerializationSettings(
    image_config=ImageConfig.auto(img_name=image)))) if image else contextlib.nullcontext()
with loading:
    from workflows.train import training_pipeline
print(json.dumps({name: t.metadata.cache_version for name, t in workflow_tasks(training_pipeline).items()
                  if t.metadata.cache}))
"""


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "acmepkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "task_mod.py").write_text(
        "from acmepkg import helper\nfrom .sub import leaf\n\ndef fn():\n    return helper.x\n"
    )
    (root / "helper.py").write_text("x = 1\n")
    (root / "unrelated.py").write_text("y = 2\n")
    (root / "sub").mkdir()
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "leaf.py").write_text("z = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.startswith("acmepkg")]:
        del sys.modules[name]


def _version(root) -> str:
    return source_hash(module_closure(["acmepkg.task_mod"], first_party=("acmepkg",)))


def test_closure_follows_absolute_and_relative_imports(pkg):
    mods = module_closure(["acmepkg.task_mod"], first_party=("acmepkg",))
    assert {"acmepkg.task_mod", "acmepkg.helper", "acmepkg.sub.leaf"} <= set(mods)
    assert "acmepkg.unrelated" not in mods


def test_version_changes_with_imported_code_only(pkg):
    before = _version(pkg)
    (pkg / "unrelated.py").write_text("y = 3\n")
    assert _version(pkg) == before
    (pkg / "sub" / "leaf.py").write_text("z = 4  # even a comment is a change\n")
    assert _version(pkg) != before


def test_a_module_that_cannot_be_found_is_an_error_not_a_gap(pkg):
    (pkg / "helper.py").write_text("from acmepkg import gone_module\n")
    (pkg / "uses.py").write_text("import acmepkg.gone_module\n")
    _version(pkg)  # `from acmepkg import name` may name an attribute: not an error
    with pytest.raises(ImportError, match=r"acmepkg.uses imports 'acmepkg.gone_module', which cannot be found"):
        module_closure(["acmepkg.uses"], first_party=("acmepkg",))


def test_the_closure_is_read_from_the_source_without_running_a_module(pkg):
    """`from acmepkg.helper import x` names an attribute of a plain module: the version is found
    without importing helper (for the pipeline strategy that import was torch's compiler)."""
    (pkg / "helper.py").write_text("raise RuntimeError('helper ran')\nx = 1\n")
    (pkg / "task_mod.py").write_text("from acmepkg.helper import x\n")
    mods = module_closure(["acmepkg.task_mod"], first_party=("acmepkg",))
    assert {"acmepkg.task_mod", "acmepkg.helper"} <= set(mods)
    assert "acmepkg.helper" not in sys.modules


# --- the real tasks, as a fresh process imports them --------------------------------------------


def _project_copy(root: Path) -> Path:
    """The project's code in `root`, importable from there (plugins/ under its import name)."""
    for name in ("flyscale", "plugins", "tasks", "workflows"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "flyscale_plugins").symlink_to(root / "plugins", target_is_directory=True)
    return root


def _versions(cwd: Path = REPO, **env: str) -> dict[str, str]:
    # The project from `cwd`; only the graph walker (tests/) from the checkout.
    full = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{REPO}", **env}
    proc = subprocess.run(
        [sys.executable, "-c", VERSIONS], cwd=cwd, env=full, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    assert set(before) == set(after) == set(TASKS)
    return {task for task in TASKS if before[task] != after[task]}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The real tasks' versions under each change, computed in parallel fresh processes."""
    root = tmp_path_factory.mktemp("versions")
    edited = _project_copy(root / "edited")
    quantizers = edited / "plugins" / "quantizers.py"
    quantizers.write_text(quantizers.read_text() + "\n# a retuned quantizer\n")
    # A newer torch, as importlib.metadata sees it: a dist-info ahead of the real one on the path.
    fake = root / "newer-torch" / "torch-9.9.9.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    cases = {
        "baseline": {},
        "again": {},
        "one_worker": {"env": {"FLYSCALE_NPROC_PER_NODE": "1"}},
        "image": {"env": {"REGISTER_IMAGE": "ghcr.io/acme/flyscale@sha256:" + "1" * 64}},
        "torch": {"env": {"PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"}},
        "store": {"env": {"MLFLOW_TRACKING_URI": "http://mlflow.elsewhere:5000"}},
        "edited_plugin": {"cwd": edited},
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_versions, c.get("cwd", REPO), **c.get("env", {})) for name, c in cases.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_an_unchanged_import_gives_the_same_versions(scenarios):
    assert scenarios["again"] == scenarios["baseline"]
    assert all(len(v) == 64 for v in scenarios["baseline"].values())


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "scenario, expected",
    [
        # One worker instead of two: another global batch, so another model, and all it feeds.
        ("one_worker", {"preflight_check", "train_model"}),
        ("image", set(TASKS)),
        ("torch", set(TASKS)),
        ("store", {"register_model", "record_candidate"}),
        ("edited_plugin", {"quantize_model", "register_model", "record_candidate"}),
    ],
)
@pytest.mark.slow
def test_each_fact_changes_the_versions_of_the_tasks_it_affects(scenarios, scenario, expected):
    assert _changed(scenarios["baseline"], scenarios[scenario]) == expected


def test_a_stage_is_stamped_when_its_body_ran_and_keeps_its_interface():
    """@stamped fills in a stage's `run` output (what the summary's cache line reads), and the
    task keeps the body's name and inputs; a training worker's None passes through."""
    import inspect
    import time
    from typing import NamedTuple

    from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped

    class Out(NamedTuple):
        value: int
        run: TaskRun = UNSTAMPED

    @stamped
    def double(x: int, rank_zero: bool = True) -> Out | None:
        time.sleep(0.01)
        return Out(2 * x) if rank_zero else None

    before = time.time()
    out = double(3)
    assert out.value == 6 and out.run.task == "double"
    assert before <= out.run.started_at <= time.time() and out.run.seconds >= 0.01
    assert double(3, rank_zero=False) is None
    assert double.__name__ == "double" and list(inspect.signature(double).parameters) == ["x", "rank_zero"]
