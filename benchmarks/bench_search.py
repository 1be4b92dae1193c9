"""The hyperparameter search's overhead and pruning's saving, as a user runs the search.

(1) Overhead. `pyflyte run workflows/search.py hyperparameter_search` with a study of 8 trials
on digits, in a fresh HOME (an empty cache) against a SQLite store. The search's own wall time
(from the study's opening to the choice of the best trial, the parent run's `search_seconds`) is
set against the sum of the trials' training time (their epochs, `trials_train_seconds`). What is
left is each trial's start (a worker process, the model, the data into memory), Flyte's local
execution of the rounds, and telling the study. The data before and the pipeline run of the best
config after are printed beside it. Goal: <= 1.5x.

(2) Pruning. A space where about half the learning rates are clearly bad (log-uniform from 1e-7
to 1e-2, where 40 epochs under 3e-5 barely train), random sampling, 8 trials: with the median pruner and without. Printed: trials pruned, and
the search's wall time with pruning against without.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GOAL = 1.5
TRIALS = 8
# Short trials, but not empty ones: a wide MLP on digits trains for several seconds a trial (the
# default MLP's 15 epochs take 0.3 s, which no orchestration of separate training tasks could match).
BASE = {
    "augment": {"copies": 0},
    "model": {"options": {"hidden": [1024, 1024], "dropout": 0.0}},
    "train": {"epochs": 40, "batch_size": 16},
    "preflight": {"enabled": False},
}


def _search(home: Path, cfg: dict) -> tuple[float, dict[str, float], str]:
    """(wall seconds, the parent run's metrics, stdout) of one search in `home`."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{home / 'mlflow.db'}"
    env = {**os.environ, "HOME": str(home), "MLFLOW_TRACKING_URI": uri, "FLYSCALE_NPROC_PER_NODE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [str(BIN / "pyflyte"), "run", "workflows/search.py", "hyperparameter_search", "--cfg", json.dumps(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    parent = re.search(r"parent run (\w+)", proc.stdout).group(1)  # type: ignore[union-attr]
    return wall, MlflowClient(uri).get_run(parent).data.metrics, proc.stdout


def overhead() -> None:
    cfg = {
        **BASE,
        "mlflow": {"model_name": "bench-search"},
        "search": {
            "trials": TRIALS,
            "concurrency": 2,
            "pruner": "none",
            "space": {
                "train.lr": {"low": 1e-3, "high": 1e-2, "log": True},
                "train.weight_decay": {"low": 1e-5, "high": 1e-2, "log": True},
            },
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        wall, metrics, _ = _search(Path(tmp), cfg)
    searched, trained = metrics["search_seconds"], metrics["trials_train_seconds"]
    ratio = searched / trained
    print(
        f"  overhead: {TRIALS} trials trained {trained:.1f} s (their epochs); the search took {searched:.1f} s: "
        f"{ratio:.2f}x (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})"
    )
    print(
        f"    each trial beyond its epochs: {(searched - trained) / TRIALS:.1f} s (a worker process, the model, "
        f"the data into memory, Flyte's local execution, the study); the rest of the {wall:.1f} s command (the "
        f"data before, the best config through the pipeline after): {wall - searched:.1f} s"
    )


def pruning() -> None:
    # Log-uniform over five decades: about half the draws fall under 3e-5.
    space = {"train.lr": {"low": 1e-7, "high": 1e-2, "log": True}}
    runs = {}
    for pruner in ("median", "none"):
        cfg = {
            **BASE,
            "mlflow": {"model_name": f"bench-prune-{pruner}"},
            "search": {
                "trials": TRIALS,
                "concurrency": 2,
                "sampler": "random",
                "pruner": pruner,
                "startup_trials": 2,
                "warmup_epochs": 2,
                "include_base": False,
                "space": space,
            },
        }
        with tempfile.TemporaryDirectory() as tmp:
            runs[pruner] = _search(Path(tmp), cfg)
    (_, pruned, _), (_, plain, _) = runs["median"], runs["none"]
    print(
        f"  pruning: {int(pruned['trials_pruned'])} of {TRIALS} trials pruned; the search took "
        f"{pruned['search_seconds']:.1f} s against {plain['search_seconds']:.1f} s without pruning "
        f"({pruned['search_seconds'] / plain['search_seconds']:.2f}x); trials trained "
        f"{pruned['trials_train_seconds']:.1f} s against {plain['trials_train_seconds']:.1f} s; best val_loss "
        f"{pruned['best_val_loss']:.4f} against {plain['best_val_loss']:.4f}"
    )


def main() -> None:
    print(f"bench_search: a study of {TRIALS} trials on digits, its wall time against its trials' training")
    overhead()
    pruning()


if __name__ == "__main__":
    main()
