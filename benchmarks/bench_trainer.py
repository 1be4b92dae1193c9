"""The training stage's per-epoch time against a hand-written PyTorch loop.

Same model, data, seed, batch size and optimizer; one process, so the ratio is our loop's
overhead (metrics, sampler, hooks), not communication. Goal: ratio <= 1.05.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from flyscale import data
from flyscale.artifacts import build_model
from flyscale.config import AugmentConfig, DataConfig, ModelConfig, TrainConfig
from flyscale.distributed import DistContext
from flyscale.training import TrainData
from plugins.strategies.ddp import DDPOptions, ddp

EPOCHS = 6
ROUNDS = 3


def _data() -> tuple[TrainData, object]:
    frame, info = data.load(DataConfig())
    train, val, _ = data.split(frame, DataConfig())
    train = data.augment(train, info, AugmentConfig(copies=2))
    x, y = data.to_tensors(train, info)
    xv, yv = data.to_tensors(val, info)
    return TrainData(x, y, xv, yv), info


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


def main() -> None:
    torch.set_num_threads(1)  # what each of the 2 local workers gets; also steadier timings
    d, info = _data()
    cfg = TrainConfig(epochs=EPOCHS, batch_size=32, seed=0)
    results: dict[str, list[float]] = {"hand-written loop": [], "flyscale trainer": []}
    for _ in range(ROUNDS):  # interleave, so drift on a shared machine hits both alike
        for name, fn in (("hand-written loop", hand_written), ("flyscale trainer", ours)):
            torch.manual_seed(0)
            model = build_model(ModelConfig(), info)
            results[name] += fn(model, d, cfg)[1:]  # the first epoch warms caches and allocators
    base = statistics.median(results["hand-written loop"])
    mine = statistics.median(results["flyscale trainer"])
    print(f"trainer vs hand-written loop: digits x3 ({len(d.y_train)} rows), mlp, batch 32, 1 thread")
    print(f"  {'hand-written loop':<20} {base * 1000:8.1f} ms/epoch (median of {len(results['hand-written loop'])})")
    print(f"  {'flyscale trainer':<20} {mine * 1000:8.1f} ms/epoch (median of {len(results['flyscale trainer'])})")
    print(f"  ratio trainer/hand-written = {mine / base:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
