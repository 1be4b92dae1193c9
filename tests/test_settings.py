"""Every FLYSCALE_* variable is declared in flyscale/settings.py, read only through it, and
documented; every config field is documented too."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from flyscale import settings
from flyscale.config import GateConfig, PipelineConfig

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bFLYSCALE_[A-Z0-9_]*[A-Z0-9]\b")
DECLARED = {s.name for s in settings.ALL}
CONFIG_DOC = REPO / "docs" / "configuration.md"


def _project_files():
    for folder in ("flyscale", "plugins", "tasks", "workflows", "infra", "configs", "docs", "benchmarks"):
        yield from (
            p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in {".py", ".yaml", ".yml", ".md"}
        )
    yield from (REPO / name for name in ("Dockerfile", "README.md", "Makefile"))


def test_every_variable_the_project_names_is_declared():
    named = {(m, str(p.relative_to(REPO))) for p in _project_files() for m in NAME.findall(p.read_text())}
    unknown = sorted(f"{where}: {name}" for name, where in named if name not in DECLARED)
    assert unknown == [], "declare these in flyscale/settings.py (or rename them):\n" + "\n".join(unknown)
    assert len({name for name, _ in named}) >= 10  # the scan really reads the project


def _env_reads_outside_settings(root: Path = REPO) -> list[str]:
    """os.environ.get / os.environ[...] / os.getenv with a FLYSCALE_* literal, anywhere but settings.py."""
    found = []
    for folder in ("flyscale", "plugins", "tasks", "workflows"):
        for path in (root / folder).rglob("*.py"):
            if path == root / "flyscale" / "settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                literal = None
                if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                    func = ast.unparse(node.func)
                    if func in {
                        "os.environ.get",
                        "os.getenv",
                        "os.environ.pop",
                        "os.environ.setdefault",
                        "environ.get",
                    }:
                        literal = node.args[0].value
                elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in {"os.environ", "environ"}:
                    literal = getattr(node.slice, "value", None)
                if isinstance(literal, str) and literal.startswith("FLYSCALE_"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {literal}")
    return found


def test_variables_are_read_only_through_settings():
    assert _env_reads_outside_settings() == [], "read it with flyscale.settings.<NAME>.get()"


def test_the_env_read_scan_catches_a_direct_read(tmp_path):
    (tmp_path / "flyscale").mkdir()
    (tmp_path / "flyscale" / "planted.py").write_text(
        'import os\na = os.environ.get("FLYSCALE_LAUNCHER")\nb = os.environ["FLYSCALE_NNODES"]\n'
    )
    assert _env_reads_outside_settings(tmp_path) == [
        "flyscale/planted.py:2: FLYSCALE_LAUNCHER",
        "flyscale/planted.py:3: FLYSCALE_NNODES",
    ]


def test_every_setting_has_a_default_a_meaning_and_a_time():
    for s in settings.ALL:
        assert s.meaning and s.when in {"registration", "run", "pod"}, s
    assert len(DECLARED) == len(settings.ALL)


def _fields(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of the config, dotted: train.epochs, mlflow.lock_timeout_s, gate.gates ..."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if f.name == "gate":  # a list of gates: each one's fields
            out += _fields(GateConfig, f"{prefix}gate.")
        elif dataclasses.is_dataclass(kind):
            out += _fields(kind, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _documented_fields(text: str) -> set[str]:
    """`section.field` for every `| `field` |` row under a `## `section`` heading."""
    found, section = set(), None
    for line in text.splitlines():
        heading = re.match(r"^## `(\w+)`", line)
        if heading or line.startswith("## "):
            section = heading.group(1) if heading else None
        row = re.match(r"^\| `(\w+)` \|", line)
        if section and row:
            found.add(f"{section}.{row.group(1)}")
    return found


def test_the_configuration_reference_lists_every_field_and_variable():
    from flyscale.scaling.config import ScalingConfig
    from flyscale.search.config import SearchConfig

    text = CONFIG_DOC.read_text()
    fields = _fields(PipelineConfig) + _fields(ScalingConfig, "scaling.") + _fields(SearchConfig, "search.")
    assert "train.epochs" in fields and "mlflow.lock_stale_s" in fields  # the walk reaches the leaves
    documented = _documented_fields(text)
    missing = [f for f in fields if f not in documented]
    missing += [s.name for s in settings.ALL if f"`{s.name}`" not in text]
    assert missing == [], f"docs/configuration.md does not document: {missing}"
    # Nor does it document a field that is not there (one renamed or removed since).
    assert documented <= set(fields), documented - set(fields)
