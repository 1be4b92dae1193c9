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
from flyscale.strict import ConfigError
from tests.conftest import run_pipeline


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "preset, message",
    [
        ("train: {epochs: -1}", "train.epochs must be > 0"),
        # Unknown keys are refused with the nearest name, in YAML and in JSON, at every depth
        # (more cases below, through the same decoder pyflyte calls, without a pyflyte each).
        ('{"model": {"name": "cnn", "options": {"chanels": [8]}}}',
         "model.options.chanels: unknown option; did you mean 'channels'?"),
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


@pytest.mark.timeout(120)
def test_inline_json_preset_is_strict_too(tmp_path):
    proc = run_pipeline(tmp_path, "--cfg", '{"train": {"epoch": 3}}')
    assert proc.returncode != 0 and "train.epoch: unknown field; did you mean 'epochs'?" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "preset, message",
    [
        ("train: {epoch: 3}", "train.epoch: unknown field; did you mean 'epochs'?"),
        ("model: {nmae: cnn}", "model.nmae: unknown field; did you mean 'name'?"),
        ("trian: {epochs: 3}", "unknown config section 'trian'; did you mean 'train'?"),
        ("recovery: {checkpoint_every_step: 5}",
         "recovery.checkpoint_every_step: unknown field; did you mean 'checkpoint_every_steps'?"),
        ("recovery: {keep_checkpoints: 0}", "recovery.keep_checkpoints must be > 0"),
    ],
)
def test_cfg_presets_decode_strictly(preset, message):
    """`pyflyte run --cfg FILE` reads the file as YAML and builds the input with PipelineConfig.from_json."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        PipelineConfig.from_json(json.dumps(yaml.safe_load(preset)))
