"""The huggingface model plugin (plugins/huggingface.py): LoRA's optimizer state against full
fine-tuning, and flyscale's fine-tuning loop against the plain transformers loop.

One small random Llama checkpoint, made offline by `flyscale.export.tiny_checkpoint` in a
temporary folder (4 layers, width 256, 4 heads and 2 key-value heads, byte vocabulary 257,
256 positions; seed 0), built through the registry as `ModelConfig(name="huggingface")` reads
it, on the shipped corpus (Python's pydoc topics) as byte ids, which is what the checkpoint's
byte-level tokenizer makes; 2 threads. What the weights are does not change a step's speed, so
the models are built, not loaded from the checkpoint's weights.

1. Optimizer state: the model built once for full fine-tuning and once with LoRA (`lora: {r: 8,
   alpha: 16}`, peft's default targets for a Llama, its query and value projections), each with
   the optimizer `make_optimizer` builds (fused AdamW over the parameters that train), after one
   step of the language-modelling objective so that AdamW's state exists. Measured: the share of
   the parameters that train (`parameter_counts`) and the bytes of every tensor in the
   optimizer's state. Goals: LoRA trains < 5% of the parameters, and its optimizer state is
   <= 0.10x full fine-tuning's. Byte counts: the same in every run.
2. Training, full fine-tuning and LoRA, one row each: flyscale's path (the ddp strategy at world
   size 1, in process: `standard_step` with the `language_modeling` objective inside `fit`, over
   packed 129-token sequences) against the loop a transformers user writes over the same rows:
   `model.hf(input_ids=x, use_cache=False).logits` (the very module flyscale's HuggingFaceModel
   calls, with the same weights), cross-entropy on the shifted targets as the objective computes
   it, backward, step, zero_grad. Both with fused AdamW over the parameters that train, the same
   lr and weight decay, no gradient clipping and no warm-up (TrainConfig's defaults: the same
   arithmetic in both loops), a fresh optimizer a round, batch 8. Each round is one flyscale epoch
   of STEPS steps and as many plain steps over the same rows, the model shared (trained on by each
   in turn), rounds interleaved, a first round not counted (lazy inits, the allocator, oneDNN's
   caches). Goal: flyscale's time per step <= 1.05x the plain loop's, on the median of the paired
   rounds' ratios (benchmarks.common.report says why paired; the fastest rounds' ratio is printed
   beside it).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_gpt import corpus, flyscale_steps
from benchmarks.common import interleaved, paired_ratios
from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TrainConfig
from flyscale.data.text import ByteTokenizer
from flyscale.export import tiny_checkpoint
from flyscale.model import build_model, parameter_counts
from flyscale.plugin import registry
from flyscale.train.step import make_optimizer

THREADS = 2
SEQ = 128  # tokens the model reads; flyscale's sequences hold one more, the last position's target
SHAPE = {"width": 256, "layers": 4, "positions": 256}
LORA = {"r": 8, "alpha": 16}
BATCH, STEPS, ROUNDS = 8, 4, 20  # each round: one flyscale epoch of STEPS steps, as many plain steps
FRACTION_GOAL, STATE_GOAL, TRAIN_GOAL = 0.05, 0.10, 1.05


def tokens_info() -> DatasetInfo:
    """Byte ids packed SEQ + 1 at a time, as flyscale.data.tokenize declares them."""
    tokens = FieldSpec("tokens", "int32", [SEQ + 1], range=[0, ByteTokenizer.vocab_size - 1])
    return DatasetInfo("pydoc-bytes", 0, [SEQ + 1], [], label_column="", fields=[tokens], input_field="tokens")


def hf_model(path: str, lora: dict | None) -> nn.Module:
    options: dict[str, Any] = {"path": path} if lora is None else {"path": path, "lora": lora}
    torch.manual_seed(0)
    return build_model(ModelConfig(name="huggingface", options=options), tokens_info())


def packed_sequences(stream: torch.Tensor) -> torch.Tensor:
    """The stream cut into rows of SEQ + 1 ids, as flyscale.data.tokenize packs a split."""
    return stream[: len(stream) // (SEQ + 1) * (SEQ + 1)].view(-1, SEQ + 1)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (AdamW: both moments and the step count)."""
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))


def state_after_one_step(model: nn.Module, batch: torch.Tensor, cfg: TrainConfig) -> int:
    """Optimizer state bytes after one step of the language-modelling objective, with the
    optimizer flyscale's trainer builds."""
    lm = registry.objectives.get("language_modeling")
    optimizer = make_optimizer(model, cfg)
    model.train()
    x, y = lm.pair(batch, None)
    lm.loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer_bytes(optimizer)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report_state(models: dict[str, nn.Module], batch: torch.Tensor, cfg: TrainConfig) -> None:
    """Part 1: the share of the parameters that train and the optimizer's state, full against LoRA."""
    print("  optimizer state after one step (make_optimizer's fused AdamW over the parameters that train):")
    states = []
    for i, (name, model) in enumerate(models.items()):
        total, trained = parameter_counts(model)
        states.append(state_after_one_step(model, batch, cfg))
        line = (
            f"    {name:<30} {trained:>9,} of {total:>9,} parameters train ({trained / total:7.2%})   "
            f"optimizer state {states[-1]:>10,} bytes ({states[-1] / 2**20:6.2f} MiB)"
        )
        if i:  # LoRA
            line += f"   (goal < {FRACTION_GOAL:.0%} train: {verdict(trained / total < FRACTION_GOAL)})"
        print(line)
    ratio = states[1] / states[0]
    print(
        f"    LoRA / full fine-tuning, optimizer state: {ratio:.4f}x "
        f"(goal <= {STATE_GOAL:.2f}: {verdict(ratio <= STATE_GOAL)})"
    )


def transformers_steps(model: nn.Module, rows: torch.Tensor, cfg: TrainConfig) -> float:
    """Seconds per step of the plain transformers loop over `rows`, `cfg.batch_size` at a time."""
    hf: Any = model.hf  # the transformers model (a peft PeftModel with LoRA) flyscale's module calls
    params = [p for p in hf.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    hf.train()
    start = time.perf_counter()
    for i in range(0, len(rows), cfg.batch_size):
        batch = rows[i : i + cfg.batch_size]
        x, y = batch[:, :-1], batch[:, 1:]
        logits = hf(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / (len(rows) // cfg.batch_size)


def training_rounds(model: nn.Module, packed: torch.Tensor, cfg: TrainConfig) -> dict[str, list[float]]:
    """Seconds per step of flyscale's trainer and of the plain loop, ROUNDS interleaved rounds
    after one not counted; in each round both train on the same slice of the corpus."""
    x_val, rows = packed[-BATCH:], STEPS * BATCH
    starts = range(0, (ROUNDS + 1) * rows, rows)  # a fresh slice a round; the corpus holds ~3,600 rows
    ours, theirs = iter(starts), iter(starts)
    runs = {
        "flyscale": lambda: [flyscale_steps(model, packed[(s := next(ours)) : s + rows], x_val, cfg)],
        "transformers": lambda: [transformers_steps(model, packed[(s := next(theirs)) : s + rows], cfg)],
    }
    interleaved(runs, 1)  # lazy inits, the allocator, oneDNN's caches
    return interleaved(runs, ROUNDS)


def report_training(name: str, t: dict[str, list[float]]) -> None:
    ours, plain = t["flyscale"], t["transformers"]
    paired = paired_ratios(ours, plain)
    median, fastest = statistics.median(paired), min(ours) / min(plain)
    print(f"    {name}:")
    for label, times in (("flyscale (ddp, world size 1)", ours), ("the transformers loop", plain)):
        print(
            f"      {label:<30} {statistics.median(times) * 1000:6.1f} ms/step median, {min(times) * 1000:6.1f} fastest"
            f"   {BATCH * SEQ / statistics.median(times):7.0f} tokens/s median"
        )
    quartiles = f"quartiles {paired[len(paired) // 4]:.3f}-{paired[(3 * len(paired)) // 4]:.3f}, {len(paired)} pairs"
    print(
        f"      flyscale / transformers: paired ratios' median {median:.3f} ({quartiles})   fastest's ratio "
        f"{fastest:.3f}   (goal <= {TRAIN_GOAL:.2f} on the paired median: {verdict(median <= TRAIN_GOAL)})"
    )


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(THREADS)
    cfg = TrainConfig(epochs=1, batch_size=BATCH, seed=0)  # no clipping, no warm-up: the plain step's arithmetic
    packed = packed_sequences(corpus())
    with tempfile.TemporaryDirectory(prefix="bench-huggingface-") as folder:
        tiny_checkpoint.make("llama", Path(folder), **SHAPE)
        full, lora = hf_model(folder, None), hf_model(folder, LORA)
        peft_model: Any = lora.hf
        targets = ", ".join(sorted(peft_model.peft_config["default"].target_modules))
        models = {"full fine-tuning": full, f"LoRA r={LORA['r']} on {targets}": lora}
        total, _ = parameter_counts(full)
        print(
            f"bench_huggingface: a random Llama checkpoint through the huggingface model plugin ({SHAPE['layers']} "
            f"layers, width {SHAPE['width']}, {total / 1e6:.2f}M parameters, byte vocabulary "
            f"{ByteTokenizer.vocab_size}), {len(packed)} packed {SEQ + 1}-token rows of the pydoc corpus, "
            f"{THREADS} threads"
        )
        report_state(models, packed[:BATCH], cfg)
        print(
            f"  training, {ROUNDS} rounds of {STEPS} steps of {BATCH} x {SEQ} tokens; AdamW fused=True over what "
            f"trains (both loops), lr {cfg.lr:g}, weight decay {cfg.weight_decay:g}, no clipping or warm-up"
        )
        for name, model in models.items():
            report_training(name, training_rounds(model, packed, cfg))


if __name__ == "__main__":
    main()
