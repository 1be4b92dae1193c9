"""DDP's own overhead: the ddp wrapper at world size 1 against the bare model, same loop.

A world-size-1 gloo group has no peer, so the ratio is the cost of DDP's hooks and bucketing
(the all-reduce is local). Goal: ratio <= 1.05.
"""

from __future__ import annotations

import socket
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from benchmarks.bench_trainer import _data
from flyscale.artifacts import build_model
from flyscale.config import ModelConfig, TrainConfig
from flyscale.distributed import DistContext
from flyscale.training import evaluate_split, fit, make_loader, make_optimizer, standard_step

EPOCHS = 6
ROUNDS = 3


def _epochs(wrap: bool, d, info, cfg) -> list[float]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(), info)
    wrapped = DistributedDataParallel(model) if wrap else model
    ctx = DistContext()
    dataset = TensorDataset(d.x_train, d.y_train)
    loader = make_loader(dataset, ctx.train_sampler(dataset, seed=0), cfg, ctx)
    opt = make_optimizer(model, cfg)
    history = fit(wrapped, standard_step(wrapped, opt, cfg, ctx.device), loader,
                  evaluate_split(model, d.x_val, d.y_val, ctx), cfg, ctx, "ddp")
    return [m.seconds for m in history.epochs[1:]]


def main() -> None:
    torch.set_num_threads(1)
    d, info = _data()
    cfg = TrainConfig(epochs=EPOCHS, batch_size=32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(ROUNDS):
            for wrap in (False, True):
                times[wrap] += _epochs(wrap, d, info, cfg)
    finally:
        dist.destroy_process_group()
    bare, ddp = statistics.median(times[False]), statistics.median(times[True])
    print("DDP at world size 1 vs no DDP: same model, data, loop; 1 thread")
    print(f"  {'no DDP':<20} {bare * 1000:8.1f} ms/epoch (median of {len(times[False])})")
    print(f"  {'DDP, world size 1':<20} {ddp * 1000:8.1f} ms/epoch (median of {len(times[True])})")
    print(f"  ratio DDP/no-DDP = {ddp / bare:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
