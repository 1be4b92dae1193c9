"""Sharded data parallelism (the fsdp strategy) against replication (ddp), two workers of one
thread each, on a GPT with tied embeddings, in one run:

- memory: the largest rank's parameters, gradients and AdamW state under fsdp (what the trainer
  itself reports per rank) against the whole model's, as one ddp worker holds it. Goal <= 0.55x.
- speed: fsdp's training throughput against ddp's (samples/s over both workers, the fastest
  epoch after the first of each, rounds interleaved), with the bytes each rank sends per step by
  the ring algorithms: ddp all-reduces the gradients once; fsdp all-gathers the parameters for
  forward and again for backward and reduce-scatters the gradients, which gloo builds on an
  all-reduce (twice NCCL's bytes). Goal >= 0.75x.
- starting weights: the anonymous memory (RssAnon: not the page cache) a worker takes at its
  peak while it loads a fine-tune's starting weights (a whole state_dict file) into its fsdp
  shards, as `TrainState.load_start` does it (the file memory-mapped) against the file read
  whole first, on a stack of Linear layers (192 MiB). Goal <= 0.6x.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import interleaved, on_ranks
from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.state import TrainState
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.fsdp import FSDPOptions, fsdp

MEMORY_GOAL, SPEED_GOAL, START_GOAL = 0.55, 0.75, 0.6
START_LAYERS, START_WIDTH = 12, 2048  # 50M parameters: 192 MiB of starting weights
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


def _anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _stack() -> nn.Module:
    return nn.Sequential(*[nn.Linear(START_WIDTH, START_WIDTH) for _ in range(START_LAYERS)])


def _start_load(ctx: DistContext, path: str, mapped: bool) -> float:
    """MiB of anonymous memory above what the rank held with its empty shards, at the peak of
    loading the starting weights into them (sampled every 5 ms)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    with torch.device("meta"):
        model = _stack()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.0))
    before, peak, done = _anonymous_bytes(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anonymous_bytes())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    if mapped:
        state.load_start(path)
    else:  # the same load, the file read whole first (as load_start did before it mapped it)
        whole = torch.load(path, map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(model, {k: whole[k] for k in model.state_dict()}, options=options)
    done.set()
    watcher.join()
    return (max(peak[0], _anonymous_bytes()) - before) / 2**20


def starting_weights() -> None:
    """Print the starting-weights measurement (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "start.pt")
        torch.save(_stack().state_dict(), path)
        mib = Path(path).stat().st_size / 2**20
        rounds = {"mapped": [], "read": []}
        for _ in range(ROUNDS):
            for how in rounds:
                rounds[how].append(max(on_ranks(_start_load, path, how == "mapped")))
    mapped, read = min(rounds["mapped"]), min(rounds["read"])
    ratio = mapped / read
    print(
        f"  start   a worker's anonymous memory at its peak, loading {mib:.0f} MiB of starting weights into its fsdp "
        f"shards: memory-mapped {mapped:.0f} MiB, read whole {read:.0f} MiB (the larger rank, the smaller of "
        f"{ROUNDS} rounds): {ratio:.3f}x (goal <= {START_GOAL}: {'met' if ratio <= START_GOAL else 'NOT met'})"
    )


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
    starting_weights()


if __name__ == "__main__":
    main()
