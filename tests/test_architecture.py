"""The habits in DESIGN.md, checked: they hold because a test fails when they break."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["flyscale", "plugins", "tasks", "workflows"]
RANK_ENV = re.compile(r"""["'](RANK|LOCAL_RANK|WORLD_SIZE)["']""")

# Each folder's import name and the layers it may import. Arrows point one way:
# workflows -> tasks -> flyscale, and plugins -> flyscale; the core imports none of the others.
LAYERS = {"flyscale": "flyscale", "plugins": "flyscale_plugins", "tasks": "tasks", "workflows": "workflows"}
ALLOWED = {
    "flyscale": {"flyscale"},
    "flyscale_plugins": {"flyscale", "flyscale_plugins"},
    "tasks": {"flyscale", "tasks"},
    "workflows": {"flyscale", "tasks", "workflows"},
}
IMPORT_FUNCTIONS = {"import_module", "__import__", "find_spec"}


def _sources():
    for pkg in PACKAGES:
        yield from sorted((REPO / pkg).rglob("*.py"))


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) for every import in the file: at top level or inside a function, and
    `importlib.import_module("...")`-style calls with a literal name, so no lazy import hides."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
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


def test_dependencies_point_one_way():
    """workflows -> tasks -> flyscale and plugins -> flyscale; nothing points back, lazily or not."""
    arrows = import_arrows()
    assert len(arrows) > 50  # the walk really sees the project's imports
    wrong = [f"{where}: {layer} imports {top}" for where, layer, top in arrows if top not in ALLOWED[layer]]
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def test_the_import_walk_catches_a_lazy_import_the_wrong_way(tmp_path):
    """The check above can fail: an import hidden in a function, or by name, is still an arrow."""
    sneaky = tmp_path / "config.py"
    sneaky.write_text(
        "def f():\n    from flyscale_plugins import models\n"
        "def g():\n    import importlib\n    return importlib.import_module('tasks.train')\n"
    )
    assert [m for _, m in imported_modules(sneaky, "flyscale.config")] == ["flyscale_plugins", "importlib", "tasks.train"]


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
        str(p.relative_to(REPO)) for p in _sources()
        if p.name != "distributed.py" and RANK_ENV.search(p.read_text())
    ]
    assert offenders == [], f"only flyscale/distributed.py may read RANK/LOCAL_RANK/WORLD_SIZE: {offenders}"


def test_no_print_in_library_code():
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    allowed = {"flyscale/cli.py"}  # a console command prints by design
    offenders = [o for o in offenders if o.split(":")[0] not in allowed]
    assert offenders == [], f"use logging, not print: {offenders}"


def test_workflows_are_wiring_only():
    """No branches, loops or arithmetic in workflow bodies: decisions belong to tasks and plugins."""
    for path in (REPO / "workflows").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            assert not isinstance(node, (ast.If, ast.For, ast.While, ast.BinOp, ast.Compare)), (
                f"{path.name}:{node.lineno}: logic in a workflow"
            )


def test_tasks_are_cached_except_those_that_read_live_state():
    """Everything is cached but the tasks whose job is to see what changed: the data's fingerprint,
    the reference and the gate (the champion as it is now), and the summary of this execution."""
    from flyscale.registration import ALWAYS_RUN
    from tests.flyte_graph import workflow_tasks
    from workflows.train import training_pipeline

    tasks = workflow_tasks(training_pipeline)  # both data branches included
    assert len(tasks) == 15  # both data branches, both publish branches
    uncached = {name for name, t in tasks.items() if not t.metadata.cache}
    assert uncached == set(ALWAYS_RUN) == {"fingerprint_data", "read_reference", "gate_model", "summarize"}


def test_configs_and_the_plugin_registry_load_without_torch():
    """`flyscale plugins`, config checks and `pyflyte run`'s config parsing start with these:
    torch (3 s) is imported by the plugins that need it, not by the contracts' annotations."""
    probe = ("import sys, flyscale.config, flyscale.registry, flyscale.cli; "
             "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

