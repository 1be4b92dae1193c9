"""Bad config through real `pyflyte run`: refused before any task starts, naming the key.

(Whole executions are checked where they run anyway: tests/test_cache_e2e.py for what a run
records and the pipeline strategy, tests/test_promotion_e2e.py and tests/test_registry_e2e.py
for the registry.)"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from flyscale.config import PipelineConfig
from flyscale.config.strict import ConfigError
from tests.conftest import run_pipeline


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "preset, message",
    [
        ("train: {epochs: -1}", "train.epochs must be > 0"),
        # Unknown keys are refused with the nearest name, in YAML and in JSON, at every depth; the
        # strict types and more keys below, through the same decoder pyflyte calls, without a
        # pyflyte each (an inline JSON preset's strict type: the user-error test at the end).
        (
            '{"model": {"name": "cnn", "options": {"chanels": [8]}}}',
            "model.options.chanels: unknown option; did you mean 'channels'?",
        ),
    ],
)
def test_bad_config_fails_before_any_task_naming_the_key(tmp_path, preset, message):
    path = tmp_path / ("bad.json" if preset.startswith("{") else "bad.yaml")
    path.write_text(preset)
    proc = run_pipeline(tmp_path, "--cfg", str(path))
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert message in log, log[-3000:]
    assert "fingerprint_data" not in log and "Checking cache for task" not in log  # no task started


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "later, message",
    [
        # A later --cfg overrides the fields it names and keeps the rest of the earlier one...
        ('{"train": {"lr": 0.01}}', "train.epochs must be > 0, got -1"),
        # ...and where both name a field, the later one wins.
        ('{"train": {"epochs": 0}}', "train.epochs must be > 0, got 0"),
    ],
)
def test_several_cfg_merge_in_order(tmp_path, later, message):
    """`--cfg a.yaml --cfg '{...}'`: both are read (not only the last), merged in order."""
    first = tmp_path / "a.yaml"
    first.write_text("train: {epochs: -1}\nmlflow: {model_name: merged}\n")
    proc = run_pipeline(tmp_path, "--cfg", str(first), "--cfg", later)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and message in log, log[-3000:]
    assert "Checking cache for task" not in log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["last", "first"])
def test_a_cfg_file_that_is_not_there_is_called_not_found(tmp_path, where):
    """The last --cfg is parsed by flytekit before flyscale sees it; either way the file is named."""
    args = ["--cfg", "configs/no-such-preset.yaml"]
    args = args + ["--cfg", "{}"] if where == "first" else ["--cfg", "{}"] + args
    proc = run_pipeline(tmp_path, *args)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "configs/no-such-preset.yaml: file not found" in log, log[-2000:]
    assert "valid json" not in log


@pytest.mark.parametrize(
    "preset, message",
    [
        ("train: {epoch: 3}", "train.epoch: unknown field; did you mean 'epochs'?"),
        # Types are checked strictly, as pydantic's strict mode does: no float truncated, no string read as a number.
        ("train: {epochs: 2.5}", "train.epochs: expected an integer, got 2.5"),
        ('train: {epochs: "5"}', "train.epochs: expected an integer, got '5'"),
        ('model: {options: {hidden: "abc"}}', "model.options.hidden: expected a list, got 'abc'"),
        ("model: {nmae: cnn}", "model.nmae: unknown field; did you mean 'name'?"),
        ("trian: {epochs: 3}", "unknown config section 'trian'; did you mean 'train'?"),
        (
            "recovery: {checkpoint_every_step: 5}",
            "recovery.checkpoint_every_step: unknown field; did you mean 'checkpoint_every_steps'?",
        ),
        ("recovery: {keep_checkpoints: 0}", "recovery.keep_checkpoints must be > 0"),
    ],
)
def test_cfg_presets_decode_strictly(preset, message):
    """`pyflyte run --cfg FILE` reads the file as YAML and builds the input with PipelineConfig.from_json."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        PipelineConfig.from_json(json.dumps(yaml.safe_load(preset)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
@pytest.mark.parametrize("kind", ["data", "config"])
def test_a_user_error_ends_in_its_own_message_and_the_traceback_is_there_when_asked(tmp_path, kind, verbose):
    """Bad data (found in a task) or bad config (before any): the message alone, naming the file or
    the field; FLYSCALE_VERBOSE=1 adds the traceback."""
    missing = tmp_path / "rows.parquet"
    if kind == "data":
        preset = {"data": {"dataset": "parquet", "options": {"path": str(missing), "num_classes": 2}}}
        message = f"dataset 'parquet': data.options.path '{missing}' does not exist"
    else:
        preset, message = {"train": {"epochs": 2.5}}, "train.epochs: expected an integer, got 2.5"
    proc = run_pipeline(tmp_path, "--cfg", json.dumps(preset), env={"FLYSCALE_VERBOSE": "1"} if verbose else {})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert message in log, log[-3000:]
    assert ("Traceback (most recent call last)" in log) is verbose, log[-3000:]
