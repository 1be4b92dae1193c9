"""Data-wait fraction with tuned DataLoader settings against `num_workers=0`.

Each example costs a fixed read latency (a stand-in for decoding from disk or object storage:
digits live in memory, so without it there is nothing for workers to hide). The ratio compares
the share of each epoch the training loop spends waiting for data.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.data import Dataset

from benchmarks.common import digits_x3 as _data
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train.batches import make_loader
from flyscale.train.distributed import DistContext
from flyscale.train.step import make_optimizer, standard_step
from flyscale.train.trainer import fit

READ_LATENCY_S = 0.0002
ROWS = 2048


class LatencyDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        time.sleep(READ_LATENCY_S)
        return self.x[i], self.y[i]


def _run(cfg: TrainConfig, d, info) -> tuple[float, float]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(), info)
    ctx = DistContext()
    dataset = LatencyDataset(d.x_train[:ROWS], d.y_train[:ROWS])
    loader = make_loader(dataset, ctx.train_sampler(dataset, seed=0), cfg, ctx)
    opt = make_optimizer(model, cfg)
    history = fit(model, standard_step(model, opt, cfg, ctx.device), loader, lambda: (0.0, 0.0, 1.0), cfg, ctx, "ddp")
    later = history.epochs[1:]  # epoch 0 pays for starting the workers
    return statistics.median(m.data_wait_fraction for m in later), statistics.median(m.seconds for m in later)


def main() -> None:
    torch.set_num_threads(1)
    d, info = _data()
    base_cfg = TrainConfig(epochs=4, batch_size=32, num_workers=0)
    tuned_cfg = TrainConfig(epochs=4, batch_size=32, num_workers=2, persistent_workers=True, prefetch_factor=4)
    base_wait, base_s = _run(base_cfg, d, info)
    tuned_wait, tuned_s = _run(tuned_cfg, d, info)
    print(f"DataLoader tuning: {ROWS} rows, {READ_LATENCY_S * 1e3:.1f} ms read latency per row, batch 32")
    print(f"  {'num_workers=0':<44} data-wait {base_wait:6.1%}  {base_s * 1000:7.1f} ms/epoch")
    print(
        f"  {'num_workers=2, persistent, prefetch_factor=4':<44} data-wait {tuned_wait:6.1%}  {tuned_s * 1000:7.1f} "
        "ms/epoch"
    )
    print(f"  ratio data-wait tuned/untuned = {tuned_wait / base_wait:.3f}; epoch time ratio = {tuned_s / base_s:.3f}")


if __name__ == "__main__":
    main()
