"""What freezing the heap saves a process that holds what a run imports (flyscale/flyte/heap.py).

Two processes, run in turn: each imports the pipeline's workflow and the libraries its tasks load
(MLflow, ONNX, ONNX Runtime, matplotlib), then makes a task's worth of young objects and exits.
One does so as every flyscale process does now (`heap.settle()` when its first stage starts),
the other as before (the collector walks the whole heap at each full collection and at exit).
Each process is timed whole, from outside; the ratio is the median of the pairs'.
Goal: the frozen process <= 0.9x the collected one.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.9
ROUNDS = 5

PROCESS = """
import sys
import workflows.train, mlflow, onnx, onnxruntime, onnxscript, matplotlib.pyplot  # what a run imports
if sys.argv[1] == "frozen":
    from flyscale.flyte import heap
    heap.settle()
work = [{"row": i, "values": [i, i + 1]} for i in range(300_000)]  # a task's objects: collections run
"""


def _seconds(mode: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", PROCESS, mode], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    print(f"bench_heap: a process holding a run's imports, its heap frozen against collected (goal <= {GOAL}x)")
    _seconds("frozen")  # warm the file cache for both
    pairs = []
    for r in range(ROUNDS):
        order = ("frozen", "collected") if r % 2 == 0 else ("collected", "frozen")
        seconds = {mode: _seconds(mode) for mode in order}
        pairs.append((seconds["frozen"] / seconds["collected"], seconds["frozen"], seconds["collected"]))
    ratio = statistics.median(p[0] for p in pairs)
    frozen, collected = (statistics.median(p[i] for p in pairs) for i in (1, 2))
    verdict = "met" if ratio <= GOAL else "NOT met"
    print(
        f"  frozen {frozen:5.2f} s   collected {collected:5.2f} s   ratio {ratio:.2f} (goal <= {GOAL}: {verdict})   "
        f"rounds: {' '.join(f'{p[0]:.2f}' for p in sorted(pairs))}"
    )


if __name__ == "__main__":
    main()
