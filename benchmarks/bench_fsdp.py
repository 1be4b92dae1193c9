"""Sharded data parallelism (the fsdp strategy) against replication (ddp), two workers of one
thread each, on a GPT with tied embeddings, in one run:

- memory: the largest rank's parameters, gradients and AdamW state under fsdp (what the trainer
  itself reports per rank) against the whole model's, as one ddp worker holds it. Goal <= 0.55x.
- speed: fsdp's training throughput against ddp's (samples/s over both workers, the fastest
  epoch after the first of each, rounds interleaved), with the bytes each rank sends per step by
  the ring algorithms: ddp all-reduces the gradients once; fsdp all-gathers the parameters for
  forward and again for backward and reduce-scatters the gradients, which gloo builds on an
  all-reduce (twice NCCL's bytes). Goal >= 0.75x.
"""

from __future__ import annotations

import torch

from benchmarks.common import interleaved, on_ranks
from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.fsdp import FSDPOptions, fsdp

MEMORY_GOAL, SPEED_GOAL = 0.55, 0.75
VOCAB, SEQ = 256, 65
GPT = {"layers": 4, "heads": 4, "width": 256}
ROWS, BATCH, EPOCHS, ROUNDS = 768, 16, 3, 2  # per-worker batch
INFO = DatasetInfo(
    "tokens",
    0,
    [SEQ],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [SEQ], range=[0, VOCAB - 1])],
    input_field="tokens",
)


def _data() -> TrainData:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (ROWS + 64, SEQ), generator=g)
    empty = torch.zeros(len(x), dtype=torch.long)
    return TrainData(
        x[:ROWS], empty[:ROWS], x[ROWS:], empty[ROWS:], objective=registry.objectives.get("language_modeling")
    )


def _train(ctx: DistContext, name: str) -> tuple[list[float], list[float]]:
    """(samples/s of each epoch after the first, MiB of state each rank held)."""
    cfg = TrainConfig(strategy=name, epochs=EPOCHS, batch_size=BATCH, seed=0)
    model = build_model(ModelConfig(name="gpt", options=GPT), INFO, meta=name == "fsdp")
    run = (
        trainer.train(fsdp, model, _data(), cfg, ctx, FSDPOptions())
        if name == "fsdp"
        else trainer.train(ddp, model, _data(), cfg, ctx, DDPOptions())
    )
    return [m.samples_per_s for m in run.history.epochs[1:]], run.history.state_mb


def main() -> None:
    params = sum(p.numel() for p in build_model(ModelConfig(name="gpt", options=GPT), INFO, meta=True).parameters())
    held: dict[str, list[float]] = {}

    def runner(name: str):
        def run() -> list[float]:
            rates, mb = on_ranks(_train, name)[0]
            held[name] = mb
            return rates

        return run

    rates = interleaved({"ddp": runner("ddp"), "fsdp": runner("fsdp")}, ROUNDS)
    whole, largest = max(held["ddp"]), max(held["fsdp"])
    print(f"fsdp against ddp: GPT {GPT} ({params:,} parameters, tied embeddings), 2 workers of 1 thread, gloo")
    memory = largest / whole
    print(
        f"  memory  parameters, gradients and AdamW state: ddp {whole:.2f} MiB a rank (the whole model), fsdp's "
        f"largest rank {largest:.2f} MiB: {memory:.3f}x (goal <= {MEMORY_GOAL}: {'met' if memory <= MEMORY_GOAL else 'NOT met'})"
    )
    fp32 = params * 4
    print(
        f"  bytes   sent a rank a step (ring, 2 ranks): ddp all-reduce {fp32 / 2**20:.1f} MiB; fsdp all-gather x2 "
        f"{fp32 / 2**20:.1f} MiB + reduce-scatter {fp32 / 2**20:.1f} MiB on gloo (an all-reduce; "
        f"{fp32 / 2 / 2**20:.1f} MiB on NCCL)"
    )
    speed = max(rates["fsdp"]) / max(rates["ddp"])
    print(
        f"  speed   ddp {max(rates['ddp']):,.0f} samples/s, fsdp {max(rates['fsdp']):,.0f} samples/s (fastest epochs): "
        f"{speed:.3f}x (goal >= {SPEED_GOAL}: {'met' if speed >= SPEED_GOAL else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
