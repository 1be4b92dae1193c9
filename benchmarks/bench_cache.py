"""A cached rerun of the whole pipeline against the uncached first run, as a user meets them.

`pyflyte run workflows/train.py training_pipeline` in a fresh HOME (so an empty local cache),
then the identical command again, three times: every cached task is a hit, and only the tasks
that read live state (the data's fingerprint, the gate's champion, the summary) run. Measured
with the default SQLite MLflow store and with a real `mlflow server` on loopback.
Goal: cached / uncached <= 0.2.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import (
    mlflow_server_at,  # the server the tests start, started the same way
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GOAL = 0.2


def _pyflyte(home: Path, uri: str) -> float:
    env = {**os.environ, "HOME": str(home), "MLFLOW_TRACKING_URI": uri}
    start = time.perf_counter()
    proc = subprocess.run(
        [str(BIN / "pyflyte"), "run", "workflows/train.py", "training_pipeline"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return seconds


def measure(uri_for) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with uri_for(root) as uri:
            uncached = _pyflyte(root, uri)
            cached = statistics.median(_pyflyte(root, uri) for _ in range(3))
    return uncached, cached


def main() -> None:
    print(
        f"bench_cache: a cached rerun of `pyflyte run ... training_pipeline` against the uncached run (goal <= {GOAL})"
    )
    stores = {
        "sqlite store": lambda root: contextlib.nullcontext(f"sqlite:///{root / 'mlflow.db'}"),
        "mlflow server": mlflow_server_at,
    }
    for name, uri_for in stores.items():
        uncached, cached = measure(uri_for)
        ratio = cached / uncached
        print(
            f"  {name:<14} uncached {uncached:6.1f} s   cached {cached:5.1f} s   ratio {ratio:.3f} "
            f"(goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
