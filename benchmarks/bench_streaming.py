"""Streaming data larger than memory: its memory, and its speed against reading into memory.

1. Peak memory of one training epoch streamed over 10x the rows of an in-memory epoch (the same
   model, features and batch), each in a fresh process through the task's own path
   (`data.train_data_from` then `TrainData.train_loader`). Goal: ratio <= 1.2. The peak is the
   epoch's own: the high-water mark is reset once the imports are done (Linux's
   /proc/self/clear_refs), since importing can peak above any epoch and hide it. The peak above
   the process's size after imports is printed beside it.
2. Rows per second of the streaming loader over a Parquet split, against reading the same split
   into memory and batching it by slicing, both interleaved in this process. Goal: ratio >= 0.8.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flyscale.train.batches import train_data_from

IN_MEMORY_ROWS = 200_000
FACTOR = 10
FEATURES = [f"f{i}" for i in range(16)]
CLASSES = 10
BATCH = 256
MEMORY_GOAL, SPEED_GOAL = 1.2, 0.8


def _write(root: Path, rows: int, seed: int) -> Path:
    """`rows` random rows as Parquet shards, written a row group at a time (so this process stays small)."""
    import pandas as pd

    from flyscale.data.shards import ROW_GROUP_ROWS, ShardWriter

    rng = np.random.default_rng(seed)
    writer = ShardWriter("bench", root=str(root))
    for start in range(0, rows, ROW_GROUP_ROWS):
        n = min(ROW_GROUP_ROWS, rows - start)
        frame = pd.DataFrame(rng.random((n, len(FEATURES)), dtype="float32"), columns=FEATURES)
        frame["label"] = rng.integers(0, CLASSES, n)
        writer.write(frame)
    writer.close()
    return root


def _info():
    from flyscale.plugin.records import DatasetInfo

    return DatasetInfo("bench", CLASSES, [len(FEATURES)], FEATURES)


def _vm(field: str) -> int | None:
    """A /proc/self/status size in KiB (VmRSS, VmHWM), None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def _reset_peak() -> bool:
    """Start the high-water mark afresh from the current size (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _epoch(train_dir: str, val_dir: str, rows: int, streamed: bool) -> dict:
    """One epoch of a linear model through the task's path; the process's peak memory."""
    import torch
    from flytekit.types.directory import FlyteDirectory

    from flyscale.config import TrainConfig
    from flyscale.data.shards import Shards
    from flyscale.train.distributed import DistContext

    reset = _reset_peak()
    after_imports = _vm("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train = Shards(FlyteDirectory(train_dir), rows, streamed=streamed)
    val = Shards(FlyteDirectory(val_dir), 4096, streamed=streamed)
    td = train_data_from(train, val, _info())
    model = torch.nn.Linear(len(FEATURES), CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = 0
    start = time.perf_counter()
    for x, y in td.train_loader(TrainConfig(batch_size=BATCH, num_workers=0), DistContext()):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        seen += len(y)
    return {
        "rows": seen,
        "seconds": time.perf_counter() - start,
        "after_imports_kib": after_imports,
        "peak_kib": _vm("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "epoch_peak": reset,
    }


def _in_child(train_dir: Path, val_dir: Path, rows: int, streamed: bool) -> dict:
    args = [
        sys.executable,
        "-m",
        "benchmarks.bench_streaming",
        "--epoch",
        str(train_dir),
        str(val_dir),
        str(rows),
        "1" if streamed else "0",
    ]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _read_into_memory(path: str) -> int:
    """The baseline: the split read whole with pyarrow, then shuffled batches gathered from it the
    way the streaming loader gathers them from its buffer (numpy, then torch without a copy)."""
    import pyarrow.dataset as ds
    import torch

    table = ds.dataset(path, format="parquet").to_table(columns=[*FEATURES, "label"])
    x = np.stack([table.column(c).to_numpy() for c in FEATURES], axis=1)
    y = table.column("label").to_numpy().astype("int64")
    perm = np.random.default_rng(0).permutation(len(y))
    seen = 0
    for i in range(0, len(y) - BATCH + 1, BATCH):
        sel = perm[i : i + BATCH]
        xb, yb = torch.from_numpy(x[sel]), torch.from_numpy(y[sel])
        seen += min(xb.shape[0], len(yb))
    return seen


def _stream(path: str) -> int:
    from flyscale.data.fields import Reader
    from flyscale.data.shards import units
    from flyscale.data.streaming import StreamingShards

    loader = StreamingShards(units(path), Reader("label", tuple(FEATURES)), BATCH, rank=0, world=1, workers=1, seed=0)
    return sum(len(y) for _, y in loader)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="flyscale-bench-stream-") as tmp:
        root = Path(tmp)
        small = _write(root / "small", IN_MEMORY_ROWS, seed=1)
        large = _write(root / "large", IN_MEMORY_ROWS * FACTOR, seed=2)
        val = _write(root / "val", 4096, seed=3)

        memory = _in_child(small, val, IN_MEMORY_ROWS, streamed=False)
        streamed = _in_child(large, val, IN_MEMORY_ROWS * FACTOR, streamed=True)
        ratio = streamed["peak_kib"] / memory["peak_kib"]
        grown = {k: (r["peak_kib"] - r["after_imports_kib"]) / 1024 for k, r in (("mem", memory), ("str", streamed))}
        which = "the epoch's own peak" if memory["epoch_peak"] else "the process's peak (no /proc to reset it)"
        print(f"bench_streaming: one epoch, {len(FEATURES)} features, batch {BATCH}, a fresh process each; {which}")
        print(
            f"  in memory {memory['rows']:>9,} rows  peak {memory['peak_kib'] / 1024:6.0f} MiB "
            f"(+{grown['mem']:.0f} after imports)   streamed {streamed['rows']:>9,} rows  peak "
            f"{streamed['peak_kib'] / 1024:6.0f} MiB (+{grown['str']:.0f})   ratio {ratio:.2f} "
            f"(goal <= {MEMORY_GOAL}: {'met' if ratio <= MEMORY_GOAL else 'NOT met'})"
        )

        rounds = {"read": [], "stream": []}
        for _ in range(3):  # interleaved, so machine drift hits both alike
            for name, fn in (("read", _read_into_memory), ("stream", _stream)):
                start = time.perf_counter()
                n = fn(str(large))
                rounds[name].append(n / (time.perf_counter() - start))
        read, stream = statistics.median(rounds["read"]), statistics.median(rounds["stream"])
        ratio = stream / read
        print(
            f"  {IN_MEMORY_ROWS * FACTOR:,} rows of Parquet: read into memory {read / 1e6:5.2f} M rows/s   "
            f"streaming loader {stream / 1e6:5.2f} M rows/s   ratio {ratio:.2f} "
            f"(goal >= {SPEED_GOAL}: {'met' if ratio >= SPEED_GOAL else 'NOT met'})"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--epoch"]:
        train_dir, val_dir, rows, streamed = sys.argv[2:6]
        print(json.dumps(_epoch(train_dir, val_dir, int(rows), streamed == "1")))
    else:
        main()
