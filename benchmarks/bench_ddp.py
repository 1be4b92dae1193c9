"""DDP's own overhead at world size 1, against the bare model.

"DDP" wraps the model exactly as the ddp strategy does on several workers (its default options
and timed comm hook) in a world-size-1 gloo group: no peer, so the ratio is the cost of DDP's
hooks and bucketing.
"ddp strategy" is what a user runs: flyscale's `ddp` strategy on one worker, which does not wrap
at world size 1 because there is nothing to synchronise. Same loop, data and model. Goal: <= 1.05.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from benchmarks.common import MODELS, digits_x3, interleaved, report
from flyscale.config import TrainConfig
from flyscale.model import build_model
from flyscale.train import trainer
from flyscale.train.batches import make_loader
from flyscale.train.distributed import DistContext
from flyscale.train.step import make_optimizer, standard_step
from flyscale.train.trainer import fit
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.ddp import wrap as wrap_ddp

EPOCHS = 5
ROUNDS = 3


def _epochs(wrap: bool, d, info, model_cfg, cfg) -> list[float]:
    torch.manual_seed(0)
    model = build_model(model_cfg, info)
    ctx = DistContext()
    wrapped = wrap_ddp(model, cfg, ctx.device, DDPOptions())[0] if wrap else model
    dataset = TensorDataset(d.x_train, d.y_train)
    loader = make_loader(dataset, ctx.train_sampler(dataset, seed=0), cfg, ctx)
    opt = make_optimizer(model, cfg)
    history = fit(
        wrapped, standard_step(wrapped, opt, cfg, ctx.device), loader, lambda: (0.0, 0.0, 1.0), cfg, ctx, "ddp"
    )
    return [m.seconds for m in history.epochs[1:]]


def _strategy_epochs(d, info, model_cfg, cfg) -> list[float]:
    torch.manual_seed(0)
    result = trainer.train(ddp, build_model(model_cfg, info), d, cfg, DistContext(), DDPOptions())
    return [m.seconds for m in result.history.epochs[1:]]


def main() -> None:
    torch.set_num_threads(1)
    d, info = digits_x3()
    cfg = TrainConfig(epochs=EPOCHS, batch_size=32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        rows = {
            name: interleaved(
                {
                    "no DDP": lambda m=m: _epochs(False, d, info, m, cfg),
                    "DDP": lambda m=m: _epochs(True, d, info, m, cfg),
                    "ddp strategy": lambda m=m: _strategy_epochs(d, info, m, cfg),
                },
                ROUNDS,
            )
            for name, m in MODELS.items()
        }
    finally:
        dist.destroy_process_group()
    report(
        "DDP at world size 1 vs no DDP: same model, data and loop; batch 32, 1 thread",
        "no DDP",
        ["DDP", "ddp strategy"],
        rows,
        goal=1.05,
    )


if __name__ == "__main__":
    main()
