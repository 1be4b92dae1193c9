"""Cache keys on facts, through real `pyflyte run` against a real MLflow server: an unchanged
rerun is all cache hits; fewer workers re-run training and what follows it; new bytes under the
same path re-run everything; the same bytes rewritten re-run only the load."""

from __future__ import annotations

import re
import shutil
import time

import numpy as np
import pandas as pd
import pytest
import yaml

from flyscale_plugins.datasets import DIGITS_PIXELS, digits
from tests.conftest import run_pipeline

DATA = ["load_data", "validate_data", "split_data", "augment_data"]
TRAINING = ["preflight_check", "train_model", "evaluate_model", "quantize_model", "register_model"]


def _cache_line(stdout: str) -> tuple[set[str], set[str]]:
    """(tasks that ran, tasks served from the cache), from the run summary."""
    match = re.search(r"cache\s+ran (.*); from the cache: (.*)", stdout)
    assert match, stdout[-3000:]
    parse = lambda text: set() if text.strip() == "nothing" else {t.strip() for t in text.split(",")}  # noqa: E731
    return parse(match.group(1)), parse(match.group(2))


@pytest.mark.timeout(1500)
def test_each_fact_reruns_exactly_what_it_changes(tmp_path, mlflow_server):
    shards = tmp_path / "shards"
    shards.mkdir()
    frame = digits.load(None)
    for i, part in enumerate(np.array_split(frame, 2)):
        part.to_parquet(shards / f"part-{i}.parquet", index=False)
    preset = tmp_path / "parquet.yaml"
    preset.write_text(yaml.safe_dump({
        "data": {"dataset": "parquet", "options": {"path": str(shards), "num_classes": 10, "input_shape": [1, 8, 8],
                                                   "ranges": {c: [0, 16] for c in DIGITS_PIXELS}}},
        "augment": {"copies": 0},
        "train": {"epochs": 3, "batch_size": 64},
        "gate": [{"name": "min_metric", "options": {"threshold": 0.5}}, {"name": "quantization"}],  # it registers
        "mlflow": {"experiment": "cache-e2e", "model_name": "cache-e2e"},
    }))
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    home = tmp_path / "home"  # one local cache for every run below
    home.mkdir()

    def run(**extra):
        proc = run_pipeline(home, "--cfg", str(preset), env={**env, **extra})
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return _cache_line(proc.stdout), proc.stdout

    (ran, cached), _ = run()
    assert ran == set(DATA + TRAINING) and cached == set()

    (ran, cached), out = run()
    assert ran == set() and cached == set(DATA + TRAINING), out[-2000:]

    # One worker instead of two: another global batch, another model. The data stays cached.
    (ran, cached), _ = run(FLYSCALE_NPROC_PER_NODE="1")
    assert ran == set(TRAINING) and cached == set(DATA)

    # A changed byte under the same path: the nightly run must see it, and retrain on it.
    part = pd.read_parquet(shards / "part-1.parquet")
    part.loc[0, "pixel_10"] = 15.0 if part.loc[0, "pixel_10"] != 15.0 else 14.0
    part.to_parquet(shards / "part-1.parquet", index=False)
    (ran, cached), out = run()
    assert ran == set(DATA + TRAINING) and cached == set(), out[-2000:]

    # The same bytes written again (a new mtime): loaded again, but identical content re-runs nothing after it.
    time.sleep(0.01)
    shutil.copy2(shards / "part-1.parquet", tmp_path / "copy.parquet")
    (shards / "part-1.parquet").write_bytes((tmp_path / "copy.parquet").read_bytes())
    (ran, cached), out = run()
    assert ran == {"load_data"} and cached == set(DATA + TRAINING) - {"load_data"}, out[-2000:]
