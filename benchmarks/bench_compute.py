"""Compute-bound training against what this CPU's fp32 matmul can do, measured in the same run.

A wide MLP (1024 -> 2048 x 3 -> 10, 10.5M parameters) on synthetic data, trained by flyscale's
trainer (the ddp strategy at world size 1, both cores), against the fp32 matmul rate of 2048 x
2048 products on the same threads. A step's FLOPs are what torch's FLOP counter counts for its
forward and backward: the matrix products. (6 x parameters x samples, printed beside, also
counts the first layer's input gradient, which is never computed: 7% more.)

Two batch sizes. At 2048 rows a step (the compute-bound config, judged: >= 90% of the peak)
the products are as large as the 2048^2 reference; at 512 the same model spends a larger share
of each step outside them (the ReLUs, the optimizer's pass over every weight), shown for scale.
The peak is the matmul rate over as many 2048^2 products as an epoch has FLOPs, run back to
back: the same length of time as an epoch, so a burst of another tenant's load on this shared
VM is as likely to hit either. Fastest epoch against fastest such block
(benchmarks.common.report says why the fastest); the medians' ratio is printed beside it, and
so is the fastest single product, which on a quiet moment bursts a few percent above any
sustained rate.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import synthetic
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train import trainer
from flyscale.train.distributed import DistContext
from flyscale.train.step import make_optimizer
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

GOAL = 0.90
FEATURES, HIDDEN, CLASSES = 1024, [2048, 2048, 2048], 10
# Batch -> training rows: 8 to 16 steps an epoch. The judged, compute-bound config is the larger batch.
BATCHES = {2048: 16384, 512: 8192}
JUDGED = 2048
THREADS = 2


def wide_mlp(info) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="mlp", options={"hidden": HIDDEN, "dropout": 0.0}), info)


N = 2048  # the reference products are N x N by N x N
PRODUCT_GFLOP = 2 * N**3 / 1e9


def matmul_gflops(block: int, blocks: int = 2) -> tuple[list[float], float]:
    """The fp32 matmul rate of `blocks` runs of `block` back-to-back N^2 products: (GFLOP/s of
    each run, GFLOP/s of the fastest single product)."""
    a, b = torch.randn(N, N), torch.randn(N, N)
    for _ in range(3):
        a @ b
    runs, fastest = [], float("inf")
    for _ in range(blocks):
        begin = time.perf_counter()
        for _ in range(block):
            start = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - start)
        runs.append(PRODUCT_GFLOP * block / (time.perf_counter() - begin))
    return runs, PRODUCT_GFLOP / fastest


def step_gflop(batch: int) -> tuple[float, int]:
    """(GFLOP of one forward and backward of the wide MLP at `batch` rows as torch's FLOP counter
    counts them, parameters)."""
    data, info = synthetic(FEATURES, batch, CLASSES, val_rows=batch)
    model = wide_mlp(info)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(data.x_train), data.y_train).backward()
    return counter.get_total_flops() / 1e9, sum(p.numel() for p in model.parameters())


def layer_gemm_gflops(batch: int, repeats: int = 10) -> tuple[float, float]:
    """The fp32 rate of the very matrix products one training step of the wide MLP makes, bare:
    per Linear layer the forward X W^T, the weight gradient dY^T X and (past the first layer,
    whose input needs no gradient) the input gradient dY W. A ceiling for this model's shapes:
    a 512-row product runs below a square 2048^2 one on some CPUs. (median, best) GFLOP/s."""
    sizes = [FEATURES, *HIDDEN, CLASSES]
    shapes = []  # (rows, inner, columns) of each product
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        shapes += [(batch, n_in, n_out), (n_out, batch, n_in)] + ([(batch, n_out, n_in)] if i else [])
    pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes]
    flops = sum(2 * m * k * n for m, k, n in shapes) / 1e9
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        for a, b in pairs:
            a @ b
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times[2:]), flops / min(times[2:])


def training_seconds(batch: int, rows: int, epochs: int = 5) -> list[float]:
    """flyscale's trainer on the wide MLP: the seconds of each epoch after the first."""
    data, info = synthetic(FEATURES, rows, CLASSES, val_rows=batch)
    result = trainer.train(
        ddp, wide_mlp(info), data, TrainConfig(epochs=epochs, batch_size=batch, seed=0), DistContext(), DDPOptions()
    )
    return [m.seconds for m in result.history.epochs[1:]]  # epoch 0 warms the allocator


def step_breakdown(batch: int, steps: int = 6) -> tuple[float, float]:
    """Seconds per step of the wide MLP's forward and backward, and of its fused AdamW update,
    timed apart: the update streams every parameter and its two moments through memory, work
    the FLOP count leaves out: part of what keeps a step under the peak."""
    data, info = synthetic(FEATURES, batch, CLASSES, val_rows=batch)
    model = wide_mlp(info)
    optimizer = make_optimizer(model, TrainConfig())
    compute, update = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(data.x_train), data.y_train).backward()
        middle = time.perf_counter()
        optimizer.step()
        compute.append(middle - start)
        update.append(time.perf_counter() - middle)
    return statistics.median(compute[1:]), statistics.median(update[1:])


def measure(batch: int, rows: int) -> None:
    flop, params = step_gflop(batch)
    block = max(1, round(flop * rows / batch / PRODUCT_GFLOP))  # an epoch's FLOPs in products
    blocks, bursts, epochs, layers = [], [], [], []

    def reference() -> None:
        runs, burst = matmul_gflops(block)
        blocks.extend(runs)
        bursts.append(burst)

    for _ in range(2):  # interleaved: drift of the machine hits both alike
        reference()
        layers.append(layer_gemm_gflops(batch))
        epochs += training_seconds(batch, rows)
        reference()
    achieved = [flop * rows / batch / s for s in epochs]
    peak, median_peak = max(blocks), statistics.median(blocks)
    got, median_got = max(achieved), statistics.median(achieved)
    own = max(r[1] for r in layers)
    ratio = got / peak
    verdict = f"(goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})" if batch == JUDGED else "(shown for scale)"
    print(
        f"  batch {batch:4d}: {got:6.1f} GFLOP/s   matmul {N}^2: {peak:6.1f} GFLOP/s (fastest epoch, fastest run of "
        f"{block} products)   ratio {ratio:.3f} {verdict}   medians {median_got:.1f} / {median_peak:.1f} = "
        f"{median_got / median_peak:.3f} ({len(achieved)} epochs, {len(blocks)} runs; "
        f"the fastest single product {max(bursts):.1f})"
    )
    print(
        f"    counted as 6 x parameters x samples instead: {got * 6 * params * batch / 1e9 / flop:.1f} GFLOP/s   "
        f"the step's own products, bare: {own:6.1f} GFLOP/s ({own / peak:.3f} of the square peak), "
        f"of which the training reaches {got / own:.3f}"
    )
    compute, update = step_breakdown(batch)
    print(
        f"    where a step's time goes: forward+backward {compute * 1000:.0f} ms, AdamW update {update * 1000:.0f} ms "
        f"({update / (compute + update):.1%} of the step, memory-bound and outside the FLOP count)"
    )


def main() -> None:
    torch.set_num_threads(THREADS)
    _, params = step_gflop(1)
    print(
        f"bench_compute: compute-bound training against the fp32 matmul peak, {THREADS} threads (goal >= {GOAL:.0%} "
        f"at batch {JUDGED}); wide MLP {FEATURES}->{'x'.join(map(str, HIDDEN))}->{CLASSES} ({params / 1e6:.1f}M "
        "parameters)"
    )
    for batch, rows in BATCHES.items():
        measure(batch, rows)


if __name__ == "__main__":
    main()
