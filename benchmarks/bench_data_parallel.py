"""Data-parallel efficiency: two DDP workers of one thread each against one process with both
threads, on the compute-bound config (bench_compute's wide MLP at a global batch of 2048), at
the same global batch.

Both run flyscale's ddp strategy; throughput is the trainer's own global samples/s, of the fastest
epoch after the first of each (benchmarks.common.report says why the fastest), with the medians'
ratio beside it. Goal: two workers >= 0.9x the one process. Every step all-reduces the same
42 MB of gradients whatever the batch, so the smaller the batch, the larger communication's
share: the wide MLP at a global batch of 512, and the default digits MLP, are shown too. There
two workers are slower (communication-bound at that size and batch), which is what the
training's data-parallel warning says when it sees it.
"""

from __future__ import annotations

import os
import statistics

import torch

from benchmarks.bench_compute import BATCHES, CLASSES, FEATURES, HIDDEN, JUDGED
from benchmarks.common import on_ranks, synthetic
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train import trainer
from flyscale.train.distributed import DistContext
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

GOAL = 0.9
EPOCHS = 4
# name: (features, hidden, global batch, training rows)
CONFIGS = {
    "wide MLP (compute-bound)": (FEATURES, HIDDEN, JUDGED, BATCHES[JUDGED]),
    "wide MLP, smaller batch": (FEATURES, HIDDEN, 512, BATCHES[512]),
    "digits-sized MLP": (64, [256, 128], 64, BATCHES[512]),
}


def _samples_per_s(ctx: DistContext, features: int, hidden: list[int], per_worker_batch: int, rows: int) -> list[float]:
    data, info = synthetic(features, rows, CLASSES)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp", options={"hidden": hidden, "dropout": 0.0}), info)
    cfg = TrainConfig(epochs=EPOCHS, batch_size=per_worker_batch, seed=0)
    history = trainer.train(ddp, model, data, cfg, ctx, DDPOptions()).history
    return [m.samples_per_s for m in history.epochs[1:]]


def two_workers(features: int, hidden: list[int], global_batch: int, rows: int) -> list[float]:
    return on_ranks(_samples_per_s, features, hidden, global_batch // 2, rows)[0]  # rank 0's rate is the global one


def one_process(features: int, hidden: list[int], global_batch: int, rows: int) -> list[float]:
    torch.set_num_threads(2)
    return _samples_per_s(DistContext(), features, hidden, global_batch, rows)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        "bench_data_parallel: 2 DDP workers x 1 thread against 1 process x 2 threads, same global batch (goal >= "
        f"{GOAL})"
    )
    for name, (features, hidden, batch, rows) in CONFIGS.items():
        ones, twos = [], []
        for _ in range(2):  # interleaved
            ones += one_process(features, hidden, batch, rows)
            twos += two_workers(features, hidden, batch, rows)
        one, two = max(ones), max(twos)
        ratio = two / one
        medians = statistics.median(twos) / statistics.median(ones)
        verdict = f"(goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})" if "compute" in name else "(for scale)"
        print(
            f"  {name:<26} global batch {batch:4d}: 1 process {one:8.0f} samples/s   2 workers {two:8.0f} samples/s "
            "(fastest epochs)   "
            f"ratio {ratio:.3f} {verdict}   medians' ratio {medians:.3f}"
        )


if __name__ == "__main__":
    main()
