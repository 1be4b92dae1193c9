"""The habits in DESIGN.md, checked: they hold because a test fails when they break."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["flyscale", "plugins", "tasks", "workflows"]
RANK_ENV = re.compile(r"""["'](RANK|LOCAL_RANK|WORLD_SIZE)["']""")


def _sources():
    for pkg in PACKAGES:
        yield from sorted((REPO / pkg).rglob("*.py"))


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


def test_every_task_is_cached_with_a_code_derived_version():
    import flytekit

    from workflows.train import training_pipeline

    tasks = {n.flyte_entity.name: n.flyte_entity for n in training_pipeline.nodes}
    assert len(tasks) == 10
    for name, t in tasks.items():
        assert isinstance(t, flytekit.core.base_task.PythonTask)
        assert t.metadata.cache, f"{name} is not cached"
        assert len(t.metadata.cache_version) == 64, f"{name}: version should be a hash, got {t.metadata.cache_version!r}"
