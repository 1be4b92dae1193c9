"""Cache keys on facts, through real `pyflyte run` against a real MLflow server: an unchanged
rerun (the nightly launch plan's, on a night with unchanged data, after a reboot emptied the
temporary folder) is all cache hits, and so is
one after another config was forced afresh (keys hold content, not where files were written);
another strategy re-runs training and what follows it; new bytes under the same path re-run everything,
even at the same size with the old mtime; the same bytes rewritten re-run only the load.

The executions double as the end-to-end checks of what they produce, so that no other test pays
for a pipeline run of its own: the first one's MLflow run (metrics, plots, the latency table,
lineage, the champion), the pipeline strategy's run (its stages, the preflight on both workers,
rank 0's Deck)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from flyscale.api import SOURCE_FILE, SOURCE_ROW
from flyscale.config import DataConfig
from flyscale.data.prepared import split_of
from flyscale.render import plots
from flyscale.render.decks import DECK_PLOTS
from flyscale_plugins.datasets import DIGITS_PIXELS, digits
from tests.conftest import NIGHTLY, run_pipeline

DATA = ["prepare_shard", "combine_shards", "augment_data"]
TRAINING = [
    "preflight_check",
    "train_model",
    "evaluate_model",
    "export_model",
    "quantize_model",
    "load_test_model",
    "register_model",
]
MODEL = "cache-e2e"


def _cache_line(stdout: str) -> tuple[set[str], set[str]]:
    """(tasks that ran, tasks served from the cache), from the run summary."""
    match = re.search(r"cache\s+ran (.*); from the cache: (.*)", stdout)
    assert match, stdout[-3000:]
    parse = lambda text: set() if text.strip() == "nothing" else {t.strip() for t in text.split(",")}  # noqa: E731
    return parse(match.group(1)), parse(match.group(2))


def _run_id(stdout: str) -> str:
    match = re.search(r"mlflow\s+run (\w+)", stdout)
    assert match, f"no run id in the summary:\n{stdout[-2000:]}"
    return match.group(1)


def _check_the_first_run(out: str, client: MlflowClient, tmp_path) -> str:
    """What the first execution recorded, read back from the tracking server."""
    run_id = _run_id(out)
    run = client.get_run(run_id)
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    # It learned (chance is 0.1): what this test holds is what reruns, not how well one config scores.
    assert metrics["test_accuracy"] >= 0.9
    assert metrics["test_accuracy"] - metrics["int8_test_accuracy"] <= 0.01
    assert metrics["int8_test_size_bytes"] < metrics["test_size_bytes"]
    assert params["train.epochs"] == "8" and params["model.name"] == "mlp"
    assert tags["flyscale.world_size"] == "2" and tags["flyscale.strategy"] == "ddp"
    # Two workers on this small MLP mostly communicate (all-reduces in flight about 57% of each
    # step here, against a warning at 25%): the run says so, on the run and in its summary.
    assert tags["flyscale.diagnosis"].startswith("communication-bound: gradient all-reduces are in flight")
    assert "  warning     communication-bound:" in out and "train.batch_size, now 64" in out
    assert [m.step for m in client.get_metric_history(run_id, "val_accuracy")] == list(range(8))
    artifacts = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert artifacts == {
        "plots/confusion_fp32.png",
        "plots/confusion_int8.png",
        "plots/reliability_fp32.png",
        "plots/learning_curves.png",
        "plots/latency.png",
    }
    # Drawn once, by the quantize task: its Deck shows the very files the run has, byte for byte.
    decks = [p.read_text() for p in tmp_path.glob("flyte-*/sandbox/local_flytekit/*/deck.html")]
    evaluation = [d for d in decks if "<h3>Evaluation on the test split</h3>" in d]
    assert len(evaluation) == 1, f"{len(decks)} deck files, {len(evaluation)} Evaluation decks"
    shown = dict(re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', evaluation[0]))
    drawn = {alt for alt, name in DECK_PLOTS.items() if name in plots.run_plots("classification")}
    assert {alt for alt in shown if alt in DECK_PLOTS} == drawn
    for alt, name in ((a, n) for a, n in DECK_PLOTS.items() if a in shown):
        logged = Path(client.download_artifacts(run_id, f"plots/{name}", str(tmp_path))).read_bytes()
        assert base64.b64decode(shown[alt]) == logged, f"the Deck's {alt} is not the run's plots/{name}"
    assert metrics["test_latency_p99_ms_b64"] >= metrics["test_latency_p50_ms_b64"] > 0
    assert metrics["test_int8_speedup_b64"] > 0 and 0 <= metrics["test_ece"] <= 1
    # The latency table as MLflow's UI shows it (log_table's JSON: columns and rows).
    table = json.loads(open(client.download_artifacts(run_id, "latency.json", str(tmp_path))).read())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert sorted({r["model"] for r in rows}) == ["fp32", "int8"]
    assert sorted({r["batch_size"] for r in rows}) == [1, 8, 64, 256]
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)
    assert client.get_model_version_by_alias(MODEL, "champion").tags["flyscale.run_id"] == run_id
    # The int8 twin is registered when it pays (smaller and faster as timed), and the run says which.
    assert re.match(r"int8 (pays|does not pay)", tags["flyscale.int8"]), tags["flyscale.int8"]
    if tags["flyscale.int8"].startswith("int8 pays"):
        assert client.get_model_version_by_alias(f"{MODEL}-int8", "champion").tags["flyscale.run_id"] == run_id
    else:
        assert not client.search_model_versions(f"name='{MODEL}-int8'")
    # What the decisions rested on is on the run: the data, the cache, the champion compared with.
    assert len(tags["flyscale.data_fingerprint"]) == 64 and "parquet" in tags["flyscale.data_fingerprint_method"]
    assert tags["flyscale.cache.train_model"] == "miss" and tags["flyscale.cache.gate_model"] == "always runs"
    assert tags["flyscale.judged_against"] == "no champion"
    return run_id


def _check_the_pipeline_strategy(proc, out: str, client: MlflowClient, tmp_path) -> None:
    """`strategy: pipeline` (2 stages, 1F1B) learns the digits as DDP does; its preflight ran on
    both workers; rank 0's Deck reached the parent process."""
    run = client.get_run(_run_id(out))
    assert run.data.tags["flyscale.strategy"] == "pipeline" and run.data.tags["flyscale.world_size"] == "2"
    assert run.data.params["train.options.schedule"] == "1f1b"
    # About 360 test rows: one row is 0.3 points, and runs of this config spread by about 2 points
    # with the seed. (Equality with one process is held exactly in tests/test_pipeline_strategy.py.)
    assert run.data.metrics["test_accuracy"] >= 0.9  # the same split, drawn as above
    log = proc.stdout + proc.stderr
    match = re.search(r"preflight passed: 5 steps of pipeline, world size 1 vs 2, max relative difference (\S+)", log)
    assert match, log[-4000:]
    assert float(match.group(1)) < 1e-5
    assert run.data.metrics["preflight_max_rel_diff"] == pytest.approx(float(match.group(1)), rel=1e-2, abs=1e-12)
    assert "preflight   PASSED: 5 steps at world size 1 vs 2" in out  # and in the summary
    assert re.search(r"^\s+5\s+\d+\.\d+\s+\d+\.\d+", log, re.MULTILINE)  # the table's last step
    # Each rank held only its stage: the two ranks' weights, gradients and AdamW state add up to
    # the whole default MLP's once (64-256-128-10: 50,826 parameters x 4 tensors x 4 bytes).
    held = re.search(r"optimizer state held per rank: ([\d.]+), ([\d.]+) MiB", log)
    assert held, log[-4000:]
    per_rank = [float(v) for v in held.groups()]
    assert sum(per_rank) == pytest.approx(50_826 * 16 / 2**20, abs=0.01) and max(per_rank) < 0.7 * sum(per_rank)
    decks = [p.read_text() for p in tmp_path.glob("flyte-*/sandbox/local_flytekit/*/deck.html")]
    curves = [d for d in decks if "<h3>Learning curves</h3>" in d and "20 epochs; last epoch" in d]
    assert curves, f"{len(decks)} deck files, none with the pipeline run's learning curves"
    assert any("<h3>Evaluation on the test split</h3>" in d for d in decks), "no Evaluation deck"
    assert 'src="data:image/png;base64,' in curves[0]


@pytest.mark.timeout(1500)
def test_each_fact_reruns_exactly_what_it_changes(tmp_path, mlflow_server):
    shards = tmp_path / "shards"
    shards.mkdir()
    frame = digits.load(None)
    for i, part in enumerate(np.array_split(frame, 2)):
        part.to_parquet(shards / f"part-{i}.parquet", index=False)
    base = {
        "data": {
            "dataset": "parquet",
            "options": {
                "path": str(shards),
                "num_classes": 10,
                "input_shape": [1, 8, 8],
                "ranges": {c: [0, 16] for c in DIGITS_PIXELS},
            },
        },
        "augment": {"copies": 0},
        "train": {"epochs": 8, "batch_size": 64},
        "gate": [{"name": "min_metric", "options": {"threshold": 0.5}}, {"name": "quantization"}],  # it registers
        "mlflow": {"experiment": "cache-e2e", "model_name": MODEL},
    }
    preset = tmp_path / "parquet.yaml"
    preset.write_text(yaml.safe_dump(base))
    # TMPDIR: flytekit's local sandbox, and so the Deck files, land under tmp_path.
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "TMPDIR": str(tmp_path)}
    home = tmp_path / "home"  # one local cache for every run below
    home.mkdir()
    client = MlflowClient(mlflow_server)

    def run(cfg=preset, run_flags=(), **extra):
        proc = run_pipeline(home, "--cfg", str(cfg), env={**env, **extra}, run_flags=run_flags)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return _cache_line(proc.stdout), proc

    def nightly():
        """The scheduled retraining (workflows/launch_plans.py), its fixed inputs being this preset."""
        proc = run_pipeline(home, env={**env, "FLYSCALE_PRODUCTION_CONFIG": str(preset)}, target=NIGHTLY)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return _cache_line(proc.stdout), proc

    (ran, cached), first = run()
    assert ran == set(DATA + TRAINING) and cached == set()
    run_id = _check_the_first_run(first.stdout, client, tmp_path)

    # A reboot (or a tmp cleaner) before the night: all the first run left in the temporary folder
    # is gone. A local run keeps what its tasks hand on under ~/.flyscale/outputs, where the cache's
    # entries point (flyscale/flyte/outputs.py), the int8 file a quantizer plugin wrote in the
    # temporary folder included; the night's run reads every cached output all the same.
    assert list((home / ".flyscale" / "outputs").glob("flyscale-shard-*"))
    left = [p for p in tmp_path.iterdir() if p not in (shards, home, preset)]
    assert any(p.name.startswith("flyscale-int8-") for p in left)  # the plugin's own file, copied
    for path in left:
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    # A night with unchanged data: the scheduled run is all cache hits (it shares the keys).
    (ran, cached), second = nightly()
    assert ran == set() and cached == set(DATA + TRAINING), second.stdout[-2000:]
    log = second.stdout + second.stderr
    # ...and plan_shards, which lists the shards and stamps nothing the summary shows.
    assert log.count("Cache hit") == len(DATA + TRAINING) + 1 and "Cache miss" not in log, log[-4000:]
    assert _run_id(second.stdout) == run_id  # the cached registration's run: nothing registered twice
    assert len(client.search_model_versions(f"name='{MODEL}'")) == 1

    # The run's own config.yaml (the effective config, every plugin default spelled out), fed back
    # with --cfg, is the same config: every cache hit again, nothing registered, no alias moved.
    logged = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "logged")))
    assert yaml.safe_load(logged.read_text())["model"]["options"]  # the defaults really are spelled out
    (ran, cached), replay = run(logged)
    assert ran == set() and cached == set(DATA + TRAINING), replay.stdout[-2000:]
    assert _run_id(replay.stdout) == run_id
    assert [v.version for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]
    assert client.get_model_version_by_alias(MODEL, "champion").version == "1"

    # Another config forced afresh (`--overwrite-cache`: every task runs again) writes the same
    # data to new files. The keys after the data hold content, not where a file was written: the
    # first config's training and everything after it stay cached. (Its gate fails, so the
    # champion, and with it the reference the data is validated against, stays.)
    forced = tmp_path / "forced.yaml"
    failing = [{"name": "min_metric", "options": {"threshold": 0.9999}}]
    forced.write_text(yaml.safe_dump({**base, "train": {"epochs": 2, "batch_size": 64}, "gate": failing}))
    (ran, cached), proc = run(forced, run_flags=("--overwrite-cache",))
    assert ran == set(DATA + TRAINING) - {"register_model"} | {"record_candidate"}, proc.stdout[-2000:]
    (ran, cached), proc = run()
    assert ran == set() and cached == set(DATA + TRAINING), proc.stdout[-2000:]
    assert _run_id(proc.stdout) == run_id  # the cached registration: nothing registered again

    # Another strategy is another model: training and what follows it run again, the data stays cached.
    # (Fewer workers likewise: the launcher is in training's cache version, tests/test_remote_serialization.py.)
    pipelined = tmp_path / "pipeline.yaml"
    pipelined.write_text(
        yaml.safe_dump(
            {
                **base,
                "train": {
                    "strategy": "pipeline",
                    "epochs": 20,
                    "batch_size": 64,
                    "options": {"schedule": "1f1b", "microbatches": 4},
                },
                "preflight": {"enabled": True, "steps": 5},
            }
        )
    )
    (ran, cached), third = run(pipelined)
    assert ran == set(TRAINING) and cached == set(DATA)
    _check_the_pipeline_strategy(third, third.stdout, client, tmp_path)
    # The same bytes as champion v1, other weights: judged against v1, so drift is measured against
    # v1 too, although validation came from the cache, where these bytes had met no reference.
    assert "judged      against v1 " in third.stdout and "none yet" not in third.stdout, third.stdout[-3000:]
    assert "  reference   v1; drift max PSI 0.000" in third.stdout, third.stdout[-3000:]
    assert "drift measured against v1, the champion the gate judged against (validation held" in third.stdout
    judged = client.get_run(_run_id(third.stdout))
    assert judged.data.tags["flyscale.data_reference"] == "v1" and judged.data.metrics["drift_psi_max"] == 0.0

    # A changed value under the same path, the file of the same size and given back its old
    # mtime (as `cp -p`, `rsync -t` or `tar x` do): the nightly run must see it. The row falls in
    # the test split: what reads that split runs again, and training, whose rows are byte for byte
    # those it was trained on, stays cached (keys hold content); so does the load test of an
    # export that came out the same.
    before = (shards / "part-1.parquet").stat()
    part = pd.read_parquet(shards / "part-1.parquet")
    # A row the seeded hash of its origin (file below the dataset's folder, and row) puts in the test split.
    origin = pd.DataFrame({SOURCE_FILE: str(shards / "part-1.parquet"), SOURCE_ROW: np.arange(len(part))})
    row = int(np.flatnonzero(split_of(origin, DataConfig(), str(shards)) == 2)[0])
    part.loc[row, "pixel_10"] = 15.0 if part.loc[row, "pixel_10"] != 15.0 else 14.0
    part.to_parquet(shards / "part-1.parquet", index=False)
    os.utime(shards / "part-1.parquet", ns=(before.st_atime_ns, before.st_mtime_ns))
    after = (shards / "part-1.parquet").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    (ran, cached), proc = nightly()
    reads_test = {"evaluate_model", "export_model", "quantize_model", "register_model"}
    assert ran == set(DATA) | reads_test, proc.stdout[-2000:]
    assert cached == set(DATA + TRAINING) - ran
    # Its data was validated against the champion's reference: drift of 64 pixels, as a summary of
    # a few metrics (the worst by name) and one table of every feature.
    changed = client.get_run(_run_id(proc.stdout))
    drift = {k for k in changed.data.metrics if k.startswith("drift_")}
    assert {"drift_psi_max", "drift_features_over_threshold", "drift_psi_label"} <= drift and len(drift) <= 10, drift
    table = json.loads(
        Path(client.download_artifacts(changed.info.run_id, "data/drift.json", str(tmp_path))).read_text()
    )
    assert len(table["data"]) == 65 and table["columns"] == ["feature", "psi"]  # 64 pixels and the label

    # The same bytes written again (a new mtime): prepared again, and what trains on the splits,
    # byte for byte the same, re-runs nothing; registration records the data's new fingerprint.
    time.sleep(0.01)
    shutil.copy2(shards / "part-1.parquet", tmp_path / "copy.parquet")
    (shards / "part-1.parquet").write_bytes((tmp_path / "copy.parquet").read_bytes())
    (ran, cached), proc = run()
    assert ran == {*DATA, "register_model"} and cached == set(DATA + TRAINING) - ran, proc.stdout[-2000:]

    # Another name for the model: the name is where the model is registered, not what is trained,
    # so training and its checks come from the cache, and only what the name reaches runs again.
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text(
        yaml.safe_dump({**base, "mlflow": {"experiment": "cache-e2e", "model_name": f"{MODEL}-renamed"}})
    )
    (ran, cached), proc = run(renamed)
    assert {"preflight_check", "train_model"} <= cached and "register_model" in ran, proc.stdout[-2000:]
    assert [v.version for v in client.search_model_versions(f"name='{MODEL}-renamed'")] == ["1"]

    # The outputs folder deleted by hand, the local cache left naming what was in it: the run
    # fails in flytekit (converting a cached output), and says which file is gone and what to do.
    shutil.rmtree(home / ".flyscale" / "outputs")
    proc = run_pipeline(home, "--cfg", str(renamed), env=env)
    assert proc.returncode == 1
    log = proc.stdout + proc.stderr
    assert f"a cached output of an earlier local run is gone: {home / '.flyscale' / 'outputs'}/" in log, log[-4000:]
    assert "pyflyte run --overwrite-cache" in log and "flyscale outputs --clear" in log
