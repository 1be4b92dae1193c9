"""The habits of docs/architecture.md, checked: they hold because a test fails when they break."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["flyscale", "plugins", "tasks", "workflows"]
RANK_ENV = re.compile(r"""["'](RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE)["']""")

# Each folder's import name. The import rules themselves are import-linter contracts in pyproject.toml.
LAYERS = {"flyscale": "flyscale", "plugins": "flyscale_plugins", "tasks": "tasks", "workflows": "workflows"}
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
IMPORT_FUNCTIONS = {"import_module", "__import__", "find_spec"}


def _sources():
    for pkg in PACKAGES:
        yield from sorted((REPO / pkg).rglob("*.py"))


def imported_modules(path: Path, module: str, calls_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in the file: at top level or inside a function, and
    `importlib.import_module("...")`-style calls with a literal name (only those, with `calls_only`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if calls_only and isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in IMPORT_FUNCTIONS and node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def import_arrows() -> list[tuple[str, str, str]]:
    """(file:line, importing layer, imported top-level name) for every first-party import."""
    names = set(LAYERS.values()) | set(LAYERS)
    arrows = []
    for path in _sources():
        rel = path.relative_to(REPO)
        layer = LAYERS[rel.parts[0]]
        module = ".".join((layer, *rel.with_suffix("").parts[1:])).removesuffix(".__init__")
        for line, imported in imported_modules(path, module):
            top = imported.split(".")[0]
            if top in names:
                arrows.append((f"{rel}:{line}", layer, top))
    return arrows


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the tree at `root` (its pyproject's contracts), importing that tree's code."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True)


def test_the_import_contracts_hold():
    """workflows -> tasks -> flyscale, plugins -> flyscale, and the core's rooms one way (pyproject.toml)."""
    out = _lint_imports(REPO)
    assert out.returncode == 0 and "0 broken" in out.stdout, out.stdout + out.stderr


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    """The project's import packages as they install (plugins/ as flyscale_plugins), to plant imports in."""
    root = tmp_path_factory.mktemp("tree")
    for folder, name in LAYERS.items():
        shutil.copytree(REPO / folder, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root)
    assert _lint_imports(root).returncode == 0  # the copy is as good as the original before a plant
    return root


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        ("flyscale/data/prepared.py", "from flyscale.tracking import store", "the core's rooms"),
        ("flyscale/config/base.py", "def f():\n    import flyscale_plugins.models", "workflows wire tasks"),
        ("tasks/common.py", "from workflows import train", "workflows wire tasks"),
    ],
)
def test_an_import_planted_the_wrong_way_breaks_a_contract(tree_copy, module, planted, broken):
    """The contracts can fail: a room importing one above it, the core importing a plugin (even
    lazily, inside a function), a task importing a workflow."""
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + "\n\n" + planted + "\n")
    try:
        out = _lint_imports(tree_copy)
    finally:
        path.write_text(original)
    assert out.returncode != 0, out.stdout
    assert f"{broken}" in out.stdout and "BROKEN" in out.stdout, out.stdout


def test_no_first_party_module_is_imported_by_name_where_the_linter_cannot_see_it():
    """import-linter reads import statements; `importlib.import_module("tasks.x")` would hide an arrow."""
    first_party = set(LAYERS.values()) | set(LAYERS)
    hidden = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in _sources()
        for line, name in imported_modules(path, "x.y", calls_only=True)
        if name.split(".")[0] in first_party
    ]
    assert hidden == []


def test_the_import_walk_sees_imports_by_name(tmp_path):
    sneaky = tmp_path / "config.py"
    sneaky.write_text("def g():\n    import importlib\n    return importlib.import_module('tasks.train')\n")
    assert [m for _, m in imported_modules(sneaky, "flyscale.config", calls_only=True)] == ["tasks.train"]


def test_every_sub_package_is_in_the_wheel():
    """pyproject lists the packages; a new room left out of it would be missing from the image."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "flyscale").rglob("__init__.py")}
    on_disk |= {
        ".".join(("flyscale_plugins", *p.parent.relative_to(REPO / "plugins").parts))
        for p in (REPO / "plugins").rglob("__init__.py")
    }
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"


def test_nothing_imports_the_plugins_folder_by_its_folder_name():
    """plugins/ installs as `flyscale_plugins`; `import plugins` would load a second copy of it."""
    offenders = [where for where, _, top in import_arrows() if top == "plugins"]
    for path in sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "benchmarks").rglob("*.py")):
        for line, imported in imported_modules(path, "tests.x"):
            if imported.split(".")[0] == "plugins":
                offenders.append(f"{path.relative_to(REPO)}:{line}")
    assert offenders == []


def test_only_distributed_module_reads_rank_variables():
    offenders = [
        str(p.relative_to(REPO)) for p in _sources() if p.name != "distributed.py" and RANK_ENV.search(p.read_text())
    ]
    assert offenders == [], (
        f"only flyscale/train/distributed.py may read RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE: {offenders}"
    )


def test_no_print_in_library_code():
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    # A console command prints by design.
    offenders = [o for o in offenders if not o.startswith("flyscale/cli/")]
    assert offenders == [], f"use logging, not print: {offenders}"


def test_workflows_are_wiring_only():
    """No branches, loops or arithmetic in workflow bodies: decisions belong to tasks and plugins.
    A comparison is allowed only as a Flyte conditional's condition (`.if_(kind == ...)`), where
    Flyte, not Python, evaluates it on a task's output."""
    for path in (REPO / "workflows").glob("*.py"):
        tree = ast.parse(path.read_text())
        conditions = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("if_", "elif_")
            and node.args
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and id(node) in conditions:
                continue
            assert not isinstance(node, (ast.If, ast.For, ast.While, ast.BinOp, ast.Compare)), (
                f"{path.name}:{node.lineno}: logic in a workflow"
            )


def test_tasks_are_cached_except_those_that_read_live_state():
    """Everything is cached but the tasks whose job is to see what changed: the model check (what
    the dataset declares now), the data's fingerprint, the reference and the gate (the champion as
    it is now), and the summary of this execution."""
    from flyscale.tracking.candidate import ALWAYS_RUN
    from tests.flyte_graph import workflow_tasks
    from workflows.train import training_pipeline

    tasks = workflow_tasks(training_pipeline)  # both data branches included
    assert len(tasks) == 18  # the data branches (one a map task), both publish branches
    uncached = {name for name, t in tasks.items() if not t.metadata.cache}
    assert (
        uncached == set(ALWAYS_RUN) == {"check_model", "fingerprint_data", "read_reference", "gate_model", "summarize"}
    )


def test_configs_and_the_plugin_registry_load_without_torch():
    """`flyscale plugins`, config checks and `pyflyte run`'s config parsing start with these:
    torch (3 s) is imported by the plugins that need it, not by the contracts' annotations."""
    probe = (
        "import sys, flyscale.config, flyscale.plugin.registry, flyscale.cli; "
        "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _repository_entry(folder: str) -> set[str]:
    """The words of `folder/`'s entry (continuation lines included) in docs/architecture.md's
    block of the repository's folders."""
    page = (REPO / "docs" / "architecture.md").read_text()
    block = page.split("## The repository", 1)[1].split("```")[1]
    entry = re.search(rf"^{folder}/ +(.*(?:\n {{2,}}.*)*)", block, re.M)
    assert entry, f"docs/architecture.md's repository block has no {folder}/ entry"
    return set(re.findall(r"\w+(?:\.py)?", entry.group(1)))


def _workflow_functions(path: Path) -> list[str]:
    """The functions `@workflow` (or `@workflow(...)`) decorates in a workflows/ module."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if getattr(target, "id", None) == "workflow":
                    found.append(node.name)
    return found


def test_the_architecture_page_names_every_strategy_task_module_and_workflow():
    """A strategy, a task module or a workflow added without a word in docs/architecture.md fails here."""
    import tomllib

    registered = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["flyscale.strategies"]
    strategies = set(registered) | {p.stem for p in (REPO / "plugins" / "strategies").glob("*.py")} - {"__init__"}
    task_modules = {p.stem for p in (REPO / "tasks").glob("*.py")} - {"__init__"}
    workflow_files = sorted(p for p in (REPO / "workflows").glob("*.py") if p.stem != "__init__")
    assert {"ddp", "fsdp", "pipeline", "hybrid"} <= strategies and "train" in task_modules and workflow_files

    plugins, tasks, workflows = (_repository_entry(f) for f in ("plugins", "tasks", "workflows"))
    missing = [f"strategy {s!r}" for s in sorted(strategies) if s not in plugins]
    missing += [f"task module tasks/{t}.py" for t in sorted(task_modules) if not {t, f"{t}.py"} & tasks]
    for path in workflow_files:
        if path.name not in workflows:
            missing.append(f"workflows/{path.name}")
        missing += [f"workflow {f} (workflows/{path.name})" for f in _workflow_functions(path) if f not in workflows]
    assert missing == [], f"docs/architecture.md's repository block does not name: {missing}"
