"""The on-disk memo of what importing the workflow computes: entries are read back instead of
recomputed, a bad entry or an unwritable folder never changes an answer, and what the entries
hold (a file's imports, a dataclass's Flyte type) follows the code they were computed from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flyscale.flyte import caching, memo
from tests.test_caching import _project_copy, pkg  # noqa: F401 (the fixture)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYSCALE_CACHE_DIR", str(tmp_path / "memo"))
    return tmp_path / "memo"


def _remember(key: str, calls: list[int], value: bytes = b"answer") -> bytes:
    def compute() -> bytes:
        calls.append(1)
        return value

    def decode(data: bytes) -> bytes:
        if not data.startswith(b"answer"):
            raise ValueError("not an answer")
        return data

    return memo.remembered("test", key, compute, lambda v: v, decode)


def test_an_entry_is_read_back_in_place_of_computing_it(folder):
    calls: list[int] = []
    assert _remember("k", calls) == b"answer"
    assert _remember("k", calls) == b"answer"
    assert len(calls) == 1
    assert (folder / "test" / "k").read_bytes() == b"answer"
    assert not [p for p in (folder / "test").iterdir() if p.name.startswith(".writing-")]


def test_a_corrupt_entry_is_recomputed_and_replaced(folder):
    calls: list[int] = []
    (folder / "test").mkdir(parents=True)
    (folder / "test" / "k").write_bytes(b"garbage")
    assert _remember("k", calls) == b"answer"
    assert len(calls) == 1
    assert (folder / "test" / "k").read_bytes() == b"answer"


def test_a_folder_that_cannot_be_written_costs_time_not_the_answer(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLYSCALE_CACHE_DIR", str(blocker / "memo"))  # under a file: mkdir fails
    calls: list[int] = []
    assert _remember("k", calls) == b"answer"
    assert _remember("k", calls) == b"answer"
    assert len(calls) == 2


def test_keys_tell_parts_apart():
    assert memo.key("ab", "c") != memo.key("a", "bc")
    assert memo.key("a") == memo.key(b"a")


def test_a_files_imports_are_parsed_once_per_content(folder, pkg, monkeypatch):  # noqa: F811 (the fixture)
    parsed: list[str] = []
    real_parse = caching.ast.parse

    def counting_parse(source, filename="<unknown>", *args, **kwargs):
        if str(filename).startswith(str(pkg)):  # pytest parses too, to show a failure
            parsed.append(str(filename))
        return real_parse(source, filename, *args, **kwargs)

    monkeypatch.setattr(caching.ast, "parse", counting_parse)
    closure = lambda: caching.module_closure(["acmepkg.task_mod"], first_party=("acmepkg",))  # noqa: E731
    first = closure()
    assert {"acmepkg.task_mod", "acmepkg.helper", "acmepkg.sub.leaf"} <= set(first) and parsed
    caching._parsed_imports.cache_clear()  # as a new process starts
    parsed.clear()
    assert closure() == first
    assert parsed == []

    (pkg / "task_mod.py").write_text("from acmepkg import helper\n")  # new content, new entry: parsed again
    caching._parsed_imports.cache_clear()
    assert "acmepkg.sub.leaf" not in closure()
    assert parsed == [str(pkg / "task_mod.py")]


LITERAL_TYPES = textwrap.dedent("""
    import json
    from flytekit.core.type_engine import DataclassTransformer, TypeEngine
    built = []
    real = DataclassTransformer.get_literal_type
    DataclassTransformer.get_literal_type = lambda self, t: built.append(t.__qualname__) or real(self, t)
    from flyscale.config import PipelineConfig, TrainConfig
    from flyscale.flyte.dataclass_types import register
    register(PipelineConfig, TrainConfig)
    train = TypeEngine.to_literal_type(TrainConfig)
    print(json.dumps({"built": built, "pipeline": str(TypeEngine.to_literal_type(PipelineConfig).to_flyte_idl()),
                      "train_fields": sorted(train.structure.dataclass_type)}))
""")


def _literal_types(project: Path, cache: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", LITERAL_TYPES],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "FLYSCALE_CACHE_DIR": str(cache), "PYTHONPATH": str(project)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


WORKFLOW_TYPES = textwrap.dedent("""
    import json
    from flytekit.core.type_engine import DataclassTransformer
    built = []
    real = DataclassTransformer.get_literal_type
    DataclassTransformer.get_literal_type = lambda self, t: built.append(repr(t)) or real(self, t)
    import workflows.train, workflows.predict, workflows.search, workflows.scaling, workflows.launch_plans
    print(json.dumps(built))
""")


@pytest.mark.slow
def test_importing_the_workflows_again_builds_no_dataclasss_flyte_type(tmp_path):
    """Every dataclass a task or workflow hands on is registered (tasks/common.py), so the second
    process to import the workflows reads each Flyte type back: one left out is built by flytekit
    in every process (tenths of a second each)."""

    def built() -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-c", WORKFLOW_TYPES],
            capture_output=True,
            text=True,
            env={**os.environ, "FLYSCALE_CACHE_DIR": str(tmp_path / "memo")},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    assert len(built()) > 50  # the first builds them all (a type asked for twice may be built twice)
    assert built() == []


@pytest.mark.slow
def test_a_dataclasss_flyte_type_is_built_once_and_follows_its_code(tmp_path):
    project = _project_copy(tmp_path / "project")
    cache = tmp_path / "memo"
    first = _literal_types(project, cache)
    assert "PipelineConfig" in first["built"] and "TrainConfig" in first["built"]
    second = _literal_types(project, cache)
    assert second["built"] == []  # every type read back
    assert second["pipeline"] == first["pipeline"]

    # A field added to a config: its type, read from the same folder, has it.
    config = project / "flyscale" / "config" / "sections.py"
    anchor = '    _section = "train"\n'
    assert anchor in config.read_text()
    config.write_text(config.read_text().replace(anchor, anchor + "    memo_probe: int = 0\n"))
    third = _literal_types(project, cache)
    assert "TrainConfig" in third["built"]
    assert "memo_probe" in third["train_fields"] and "memo_probe" not in first["train_fields"]
