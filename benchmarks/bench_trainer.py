"""The training stage's per-epoch time against the fastest plain PyTorch loop.

The baseline indexes a shuffled tensor with one gather per batch, as the issue that set the goal
defines it. Same model (one instance, trained on by each loop in turn), data, seed, batch size
and optimizer; one process, so the ratio is our loop's cost (metrics, sampler, checkpoint hooks)
net of what its data path saves, not communication. Goal: ratio <= 1.02, judged on the median of
the paired epochs' ratios over interleaved rounds (each flyscale epoch over the plain epoch of the
same round); the fastest epochs' ratio is printed beside it (benchmarks.common.report weighs the
two). Printed for scale: the tutorial's DataLoader loop, `train.track_train_accuracy`, a plain
loop that gathers each epoch whole (flyscale gathers up to 64 MiB at a time, which is the whole
epoch here, so against it only the loop's own work is left), and the step and the loop alone
over pre-sliced batches."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from benchmarks.common import MODELS, digits_x3, interleaved, paired_ratios, report
from flyscale.config import TrainConfig
from flyscale.model import build_model
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.loop import train_epoch
from flyscale.train.step import standard_step
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

ROUNDS = 48  # each round trains one epoch with every loop, in turn; many short rounds make tight pairs


def _plain(model, cfg: TrainConfig, epoch_batches) -> list[float]:
    """The textbook step over each epoch's batches (`epoch_batches()` gives an epoch's), timed per epoch."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
    )  # the fastest form
    times = []
    for _ in range(cfg.epochs):
        model.train()
        start = time.perf_counter()
        for xb, yb in epoch_batches():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - start)
    return times


def sliced(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """The fastest plain loop: a fresh permutation each epoch, one index gather per batch."""
    g = torch.Generator().manual_seed(cfg.seed)
    n = len(d.y_train)

    def batches():
        order = torch.randperm(n, generator=g)
        for i in range(0, n, cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            yield d.x_train.index_select(0, idx), d.y_train.index_select(0, idx)

    return _plain(model, cfg, batches)


def gathered(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """The same, with the whole epoch gathered in one go and every batch a view of it (twice the
    data in memory for the epoch: the fastest loop there is, for data that fits twice)."""
    g = torch.Generator().manual_seed(cfg.seed)
    n = len(d.y_train)

    def batches():
        order = torch.randperm(n, generator=g)
        xs, ys = d.x_train.index_select(0, order), d.y_train.index_select(0, order)
        for i in range(0, n, cfg.batch_size):
            yield xs[i : i + cfg.batch_size], ys[i : i + cfg.batch_size]

    return _plain(model, cfg, batches)


def hand_written(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """The loop a person writes from the PyTorch tutorial: a DataLoader over a TensorDataset."""
    g = torch.Generator().manual_seed(cfg.seed)
    loader = DataLoader(
        TensorDataset(d.x_train, d.y_train), batch_size=cfg.batch_size, sampler=RandomSampler(d.x_train, generator=g)
    )
    return _plain(model, cfg, lambda: loader)


def ours(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """flyscale's trainer (the ddp strategy at world size 1), per-epoch training time."""
    result = trainer.train(ddp, model, d, cfg, DistContext(), DDPOptions())
    return [m.seconds for m in result.history.epochs]


def ours_with_train_accuracy(model, d: TrainData, cfg: TrainConfig) -> list[float]:
    """The same, with `train.track_train_accuracy` on (three more small kernels per step)."""
    return ours(model, d, dataclasses.replace(cfg, track_train_accuracy=True))


def per_step(model, d: TrainData, cfg: TrainConfig, steps: int = 100, rounds: int = 60) -> dict[str, float]:
    """Seconds a step of the plain loop, of flyscale's step alone, and of flyscale's epoch loop
    around it: each the fastest of `rounds` blocks of `steps` batches, sliced beforehand, on one
    model, the three in a fresh random order every round. Finer than whole epochs: a block takes
    a twentieth of the time, and no sampler or model build sits in it."""
    batches = [
        (d.x_train[i : i + cfg.batch_size].clone(), d.y_train[i : i + cfg.batch_size].clone())
        for i in range(0, steps * cfg.batch_size, cfg.batch_size)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    step = standard_step(model, opt, cfg, torch.device("cpu"))
    model.train()

    def plain() -> None:
        for xb, yb in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    def step_only() -> None:
        for xb, yb in batches:
            step(xb, yb)

    runs = {
        "plain": plain,
        "flyscale step": step_only,
        "flyscale loop": lambda: train_epoch(step, batches, DistContext(), None),
    }  # type: ignore[arg-type]
    best = dict.fromkeys(runs, float("inf"))
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(list(runs), len(runs)):
            start = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds / steps for name, seconds in best.items()}


def main() -> None:
    torch.set_num_threads(1)  # what each of the 2 local workers gets; also steadier timings
    d, info = digits_x3()
    cfg = TrainConfig(epochs=1, batch_size=32, seed=0)

    def timed(fn, model):
        return lambda: fn(model, d, cfg)

    def compare(model_cfg) -> dict[str, list[float]]:
        # One model for every loop, trained on from where the last left it (a step's speed does
        # not depend on the weights' values): every loop works on the very same tensors, at the
        # same places in memory, so what differs between the runs is the loop alone. One epoch a
        # run, so each flyscale epoch has its plain one a fraction of a second away (its pair).
        torch.manual_seed(0)
        model = build_model(model_cfg, info)
        runs = {
            "plain": timed(sliced, model),
            "plain, gathered an epoch at a time": timed(gathered, model),
            "flyscale": timed(ours, model),
            "flyscale+train-acc": timed(ours_with_train_accuracy, model),
            "DataLoader loop": timed(hand_written, model),
        }
        interleaved(runs, len(runs))  # a round for each to go first, not counted: caches, allocator, lazy inits
        return interleaved(runs, ROUNDS)

    rows = {name: compare(m) for name, m in MODELS.items()}
    report(
        f"trainer vs the fastest plain loop: digits x3 ({len(d.y_train)} rows), batch 32, 1 thread",
        "plain",
        ["flyscale"],
        rows,
        goal=1.02,
        judge="paired",
    )
    for name, t in rows.items():
        for label, run in (
            ("the tutorial's DataLoader loop", "DataLoader loop"),
            ("flyscale with train.track_train_accuracy", "flyscale+train-acc"),
        ):
            print(
                f"  {name:<24} for scale: {label} {min(t[run]) * 1000:7.1f} ms/epoch, paired ratios' median "
                f"{statistics.median(paired_ratios(t[run], t['plain'])):.3f}x the plain loop"
            )
        fastest = "plain, gathered an epoch at a time"
        print(
            f"  {name:<24} for scale: the plain loop gathering each epoch whole {min(t[fastest]) * 1000:7.1f} "
            "ms/epoch; "
            f"flyscale over it: paired ratios' median {statistics.median(paired_ratios(t['flyscale'], t[fastest])):.3f}"
        )
    for name, m in MODELS.items():
        torch.manual_seed(0)
        t = per_step(build_model(m, info), d, cfg)
        print(
            f"  {name:<24} per step (fastest of 60 blocks of 100 steps, random order): plain {t['plain'] * 1e6:6.1f} "
            "us   "
            + "   ".join(
                f"{k} {t[k] * 1e6:6.1f} us ({t[k] / t['plain']:.3f}x)" for k in ("flyscale step", "flyscale loop")
            )
        )


if __name__ == "__main__":
    main()
