"""Where a local run keeps the files its tasks hand on (flyscale/flyte/outputs.py), and `flyscale
outputs --clear`, which deletes them with the Flyte local cache that names them. That a run after a
reboot still reads every cached output is tests/test_cache_e2e.py's, through `pyflyte run`."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from diskcache import Cache
from flytekit.core.context_manager import ExecutionState, FlyteContextManager

from flyscale.flyte import outputs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def local_run(tmp_path, monkeypatch):
    """This test inside a task of a local Flyte execution, with HOME and the temporary folder in
    tmp_path (apart: the checkout, a user's files, may itself lie under /tmp)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    ctx = FlyteContextManager.current_context()
    state = ctx.execution_state.with_params(mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION)
    with FlyteContextManager.with_context(ctx.with_execution_state(state)):
        yield tmp_path / "home" / ".flyscale" / "outputs"


def test_outside_a_run_an_output_folder_is_a_temporary_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = outputs.output_dir("flyscale-x-")
    assert folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("flyscale-x-")
    assert not (tmp_path / ".flyscale").exists()
    folder.rmdir()


def test_a_local_run_writes_under_its_outputs_folder_and_copies_a_temporary_file_there(local_run):
    folder = outputs.output_dir("flyscale-x-")
    assert folder.parent == local_run and folder.name.startswith("flyscale-x-")
    assert outputs.kept(folder, "flyscale-y-") == folder  # already there: nothing copied

    written = Path(tempfile.mkdtemp(prefix="plugin-")) / "model.onnx"  # a plugin's own choice
    written.write_bytes(b"int8")
    copy = outputs.kept(written, "flyscale-int8-")
    assert copy.parent.parent == local_run and copy.name == "model.onnx" and copy.read_bytes() == b"int8"
    assert written.exists()  # copied, not moved: something else may still read it


def test_a_file_outside_the_temporary_folder_stays_where_it_is(local_run, tmp_path):
    mine = tmp_path / "weights.pt"  # the user's own file: not ours to copy or move
    mine.write_bytes(b"weights")
    assert outputs.kept(mine, "flyscale-x-") == mine
    assert not local_run.exists()


def test_outputs_clear_deletes_the_files_and_the_local_cache_that_names_them(tmp_path):
    home = tmp_path / "home"
    kept = home / ".flyscale" / "outputs" / "flyscale-shard-00000-abc"
    kept.mkdir(parents=True)
    (kept / "part.parquet").write_bytes(b"x" * 2**20)
    with Cache(str(home / ".flyte" / "local-cache")) as cache:  # where flytekit keeps it
        cache.set("an entry", b"naming the file above")
    env = {**os.environ, "HOME": str(home)}

    def flyscale(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "flyscale.cli", "outputs", *args], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert f"local runs' outputs: {home / '.flyscale' / 'outputs'}, 1.0 MiB" in flyscale()
    assert "(1.0 MiB) and emptied Flyte's local cache" in flyscale("--clear")
    assert not (home / ".flyscale" / "outputs").exists()
    with Cache(str(home / ".flyte" / "local-cache")) as cache:
        assert len(cache) == 0


def test_a_failure_naming_a_deleted_output_says_which_and_what_to_do(local_run):
    there = outputs.output_dir("flyscale-plots-")
    deleted = local_run / "flyscale-int8-abc" / "model_int8.onnx"
    # As flytekit words it: the dataclass's field, and its dump of the cached literal's bytes.
    error = (
        "Error encountered while converting inputs of 'tasks.evaluate.gate_model':\n"
        f"  Field \"weights\" of type FlyteFile in QuantizedModel has invalid value {{'path': '{deleted}'}}\n"
        f"  b'\\x86\\xa7weights\\x81\\xa4path\\xd9<{deleted}\\247metrics' {there}\\246format"
    )
    hint = outputs.gone(error)
    assert hint.startswith(f"a cached output of an earlier local run is gone: {deleted}. ")
    assert "--overwrite-cache" in hint and "flyscale outputs --clear" in hint
    assert outputs.gone(f"ValueError: data.options.path '{there}' holds no Parquet file") == ""
