"""What checkpointing costs: training with checkpoints against the same training without, in the
same run, alternated.

Two models: the default MLP (a checkpoint is ~0.1 MB) and a wide MLP (64 -> 2048 x 3 -> 10, about
8.5M parameters: model and AdamW state make ~100 MB a checkpoint, so writing and hashing show).
Two intervals: the default (`recovery.checkpoint_every_minutes` unset: a tenth of the run,
between 30 s and 5 minutes) and an aggressive one, a checkpoint every 25 steps, written
asynchronously (the default, `dcp.async_save`) and synchronously. A digits run lasts seconds, so
at the default interval it writes no checkpoint at all; its ratio is measured, and beside it the
projection for runs long enough to write them, at the automatic interval's shortest (30 s, a run
of 5 minutes or less) and longest (5 minutes): 1 + (seconds training waits per checkpoint) /
(interval). Goal: <= 1.03 at the default.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import digits_x3
from flyscale.config import ModelConfig, RecoveryConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train import trainer
from flyscale.train.checkpoint import AUTO_LEAST_S, AUTO_MOST_S, Checkpointer
from flyscale.train.distributed import DistContext
from flyscale.train.loop import Hooks
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

ROUNDS = 3
GOAL = 1.03
MODELS = {
    "mlp (default)": (ModelConfig(), TrainConfig(epochs=4, batch_size=32)),
    "wide mlp (8.5M params)": (
        ModelConfig(options={"hidden": [2048, 2048, 2048]}),
        TrainConfig(epochs=1, batch_size=128),
    ),
}


def _train(
    model_cfg: ModelConfig, cfg: TrainConfig, data, info, checkpointer: Checkpointer | None
) -> tuple[float, int, float]:
    """(training seconds, checkpoints written, seconds spent writing them)."""
    torch.manual_seed(0)
    model = build_model(model_cfg, info)
    start = time.perf_counter()
    if checkpointer is None:
        trainer.train(ddp, model, data, cfg, DistContext(), DDPOptions())
        return time.perf_counter() - start, 0, 0.0
    trainer.train(ddp, model, data, cfg, DistContext(), DDPOptions(), Hooks(checkpointer=checkpointer))
    return time.perf_counter() - start, len(checkpointer.saved), checkpointer.seconds_saving


def main() -> None:
    data, info = digits_x3()
    default = RecoveryConfig()
    print(f"checkpoint cost: training with checkpoints / without, one process, median of {ROUNDS} alternated runs")
    for name, (model_cfg, cfg) in MODELS.items():
        times: dict[str, list[float]] = {"off": [], "default": [], "25 async": [], "25 sync": []}
        waits: dict[str, list[float]] = {"25 async": [], "25 sync": []}
        for _ in range(ROUNDS):
            with tempfile.TemporaryDirectory() as tmp:
                times["off"].append(_train(model_cfg, cfg, data, info, None)[0])
                t, _, _ = _train(
                    model_cfg,
                    cfg,
                    data,
                    info,
                    Checkpointer(
                        Path(tmp) / "default",
                        every_steps=default.checkpoint_every_steps,
                        every_minutes=default.checkpoint_every_minutes,
                        keep=default.keep_checkpoints,
                        asynchronous=default.async_checkpoints,
                    ),
                )
                times["default"].append(t)
                for mode, asynchronous in (("25 async", True), ("25 sync", False)):
                    t, n, waited = _train(
                        model_cfg,
                        cfg,
                        data,
                        info,
                        Checkpointer(
                            Path(tmp) / mode.replace(" ", "-"),
                            every_steps=25,
                            keep=default.keep_checkpoints,
                            asynchronous=asynchronous,
                        ),
                    )
                    times[mode].append(t)
                    waits[mode].append(waited / max(n, 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        wait = {k: statistics.median(v) for k, v in waits.items()}
        shortest, longest = (1 + wait["25 async"] / interval for interval in (AUTO_LEAST_S, AUTO_MOST_S))
        print(
            f"  {name:<24} off {med['off']:6.2f} s   default {med['default']:6.2f} s  ratio "
            f"{med['default'] / med['off']:.3f}   every 25 steps: async {med['25 async'] / med['off']:.3f}x, "
            f"sync {med['25 sync'] / med['off']:.3f}x"
        )
        print(
            f"  {'':<24} training waits {wait['25 async'] * 1000:.1f} ms a checkpoint async, "
            f"{wait['25 sync'] * 1000:.1f} ms sync: at the default interval a run pays {shortest:.4f}x "
            f"(every {AUTO_LEAST_S:g} s) to {longest:.4f}x (every {AUTO_MOST_S / 60:g} minutes) "
            f"(goal <= {GOAL:.2f}: {'met' if shortest <= GOAL else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
