"""The training stage's per-epoch time against a hand-written PyTorch loop.

Same model, data, seed, batch size and optimizer; one process, so the ratio is our loop's
overhead (metrics, sampler, hooks), not communication. Goal: ratio <= 1.05.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from benchmarks.common import MODELS, digits_x3, interleaved, report
from flyscale.artifacts import build_model
from flyscale.config import TrainConfig
from flyscale.distributed import DistContext
from flyscale.training import TrainData
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

EPOCHS = 5
ROUNDS = 3


def hand_written(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """The loop a person writes from the PyTorch tutorial, timed per epoch (training only)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(cfg.seed)
    loader = DataLoader(TensorDataset(d.x_train, d.y_train), batch_size=cfg.batch_size, sampler=RandomSampler(d.x_train, generator=g))
    times = []
    for _ in range(cfg.epochs):
        model.train()
        start = time.perf_counter()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - start)
    return times


def ours(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """flyscale's trainer (the ddp strategy at world size 1), per-epoch training time."""
    result = ddp(model, d, cfg, DistContext(), DDPOptions())
    return [m.seconds for m in result.history.epochs]


def ours_with_train_accuracy(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """The same, with `train.track_train_accuracy` on (three more small kernels per step)."""
    return ours(model, d, dataclasses.replace(cfg, track_train_accuracy=True))


def main() -> None:
    torch.set_num_threads(1)  # what each of the 2 local workers gets; also steadier timings
    d, info = digits_x3()
    cfg = TrainConfig(epochs=EPOCHS, batch_size=32, seed=0)

    def timed(fn, model_cfg):
        def run() -> list[float]:
            torch.manual_seed(0)
            return fn(build_model(model_cfg, info), d, cfg)[1:]  # epoch 0 warms caches and allocators
        return run

    rows = {
        name: interleaved(
            {
                "hand-written": timed(hand_written, m),
                "flyscale": timed(ours, m),
                "flyscale+train-acc": timed(ours_with_train_accuracy, m),
            },
            ROUNDS,
        )
        for name, m in MODELS.items()
    }
    report(f"trainer vs hand-written loop: digits x3 ({len(d.y_train)} rows), batch 32, 1 thread",
           "hand-written", ["flyscale", "flyscale+train-acc"], rows, goal=1.05)


if __name__ == "__main__":
    main()
