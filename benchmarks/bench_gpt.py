"""The GPT model plugin (plugins/gpt.py) in training and generation, against nanoGPT's plain loops.

One model, built through the registry (seed 0; 4 layers, width 128, 4 heads, byte vocabulary
257, reading 128 tokens), on the shipped corpus (Python's pydoc topics) as byte ids, 2 threads:

1. Training: flyscale's path (the ddp strategy at world size 1, in process: `standard_step` with
   the `language_modeling` objective inside `fit`, over `TensorBatches` of packed 129-token
   sequences) against the loop nanoGPT's train.py writes (get_batch: random 128-token windows of
   the token stream, stacked; forward; cross-entropy; zero_grad; backward; step). Both with AdamW,
   fused (what `make_optimizer` gives on CPU), the same lr and weight decay on every parameter
   (nanoGPT exempts norms and biases from decay: the same arithmetic, so the same speed), a fresh
   optimizer a round, the same batch of 16 and the same number of steps. Each round is one
   flyscale epoch of STEPS steps and as many plain steps, the model shared (trained on by each in
   turn), rounds interleaved, a first round not counted (lazy inits, allocator, oneDNN's caches).
   Goal: flyscale's time per step <= 1.03x the plain loop's, on the median of the paired rounds'
   ratios (benchmarks.common.report says why paired; the fastest rounds' ratio is printed beside).
2. Compute: a step's FLOPs as torch's FlopCounterMode counts them (forward and backward; the
   optimizer's update is not counted), over the measured time of flyscale's step, against the fp32
   rate of 2048^2 `torch.mm` products timed in the same rounds. Torch's counter has no formula for
   the CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu`, forward and backward):
   it would count attention as nothing, so the formulas torch uses for the GPU kernels (the whole
   T x T score matrix, not halved for the causal mask) are mapped onto it. Printed: the attention
   share of the FLOPs and the fraction of the matmul peak reached. No goal.
3. Generation at batch 1, greedy: `flyscale.api.generate` (what the served model and the Deck's
   samples call; no KV cache) against the bare loop (`model(ids[:, -ctx:])[:, -1]`, argmax, cat,
   under inference_mode), the same prompt and number of new tokens, interleaved rounds. Goal:
   flyscale's tokens/s >= 0.9x the bare loop's. `generation_seconds` takes any callable that
   generates n tokens, so the registered MLflow model's predict can join the comparison.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from benchmarks.common import interleaved, paired_ratios
from flyscale.api import DatasetInfo, FieldSpec, generate
from flyscale.config import ModelConfig, TrainConfig
from flyscale.data.text import ByteTokenizer
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

THREADS = 2
CONTEXT = 128  # tokens the model reads; flyscale's sequences hold one more, the last position's target
OPTIONS = {"layers": 4, "heads": 4, "width": 128}
BATCH, STEPS, ROUNDS = 16, 4, 20  # each round: one flyscale epoch of STEPS steps, as many plain steps
TRAIN_GOAL, GENERATION_GOAL = 1.03, 0.90
PROMPT, NEW_TOKENS, GENERATION_ROUNDS = 64, 128, 16  # the window fills after 64 new tokens
N = 2048  # the reference products are N x N by N x N
PRODUCT_GFLOP = 2 * N**3 / 1e9
aten = torch.ops.aten
CPU_ATTENTION = {  # torch's own formulas for the GPU kernels, on the shapes of the CPU kernels' first arguments
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *_, **__: sdpa_backward_flop_count(grad, q, k, v)
    ),
}


def corpus() -> torch.Tensor:
    """Every pydoc topic's UTF-8 bytes, end-of-text after each, as one stream of int64 ids."""
    tok = ByteTokenizer()
    ids = tok.encode_batch([topics[name] for name in sorted(topics)])
    return torch.from_numpy(np.concatenate([np.append(i, tok.eot) for i in ids]).astype("int64"))


def sequences_info() -> DatasetInfo:
    """What flyscale.data.tokenize.sequences_info declares for byte ids packed CONTEXT + 1 at a time."""
    tokens = FieldSpec("tokens", "int32", [CONTEXT + 1], range=[0, ByteTokenizer.vocab_size - 1])
    return DatasetInfo("pydoc-bytes", 0, [CONTEXT + 1], [], label_column="", fields=[tokens], input_field="tokens")


def gpt_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt", options=OPTIONS), sequences_info())


def packed_sequences(stream: torch.Tensor) -> torch.Tensor:
    """The stream cut into rows of CONTEXT + 1 ids, as flyscale.data.tokenize packs a split."""
    return stream[: len(stream) // (CONTEXT + 1) * (CONTEXT + 1)].view(-1, CONTEXT + 1)


def flyscale_steps(model: nn.Module, x_train: torch.Tensor, x_val: torch.Tensor, cfg: TrainConfig) -> float:
    """Seconds per step of one epoch of flyscale's trainer over `x_train` (validation after it, untimed)."""
    lm = registry.objectives.get("language_modeling")
    none = torch.zeros(len(x_train), dtype=torch.long)  # no labels: the objective scores the tokens
    data = TrainData(x_train, none, x_val, none[: len(x_val)], objective=lm)
    (epoch,) = trainer.train(ddp, model, data, cfg, DistContext(), DDPOptions()).history.epochs
    return epoch.seconds / (len(x_train) // cfg.batch_size)


def nanogpt_steps(model: nn.Module, stream: torch.Tensor, cfg: TrainConfig, g: torch.Generator) -> float:
    """Seconds per step of STEPS steps of nanoGPT's train.py loop, its get_batch included."""

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(stream) - CONTEXT, (cfg.batch_size,), generator=g)
        x = torch.stack([stream[i : i + CONTEXT] for i in ix])
        y = torch.stack([stream[i + 1 : i + 1 + CONTEXT] for i in ix])
        return x, y

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    model.train()
    start = time.perf_counter()
    for _ in range(STEPS):
        x, y = get_batch()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / STEPS


def matmul_gflops(block: int) -> float:
    """The fp32 rate of `block` back-to-back N^2 products, GFLOP/s."""
    a, b = torch.randn(N, N), torch.randn(N, N)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(block):
        torch.mm(a, b)
    return PRODUCT_GFLOP * block / (time.perf_counter() - start)


def step_flops(model: nn.Module, sequences: torch.Tensor, mapping: dict | None = None) -> tuple[float, float]:
    """(GFLOP, of which attention) of one forward and backward of the language-modelling step."""
    lm = registry.objectives.get("language_modeling")
    x, y = lm.pair(sequences, None)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        lm.loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    ops = counter.get_flop_counts()["Global"]
    attention = sum(n for op, n in ops.items() if "scaled_dot_product" in str(op))
    return counter.get_total_flops() / 1e9, attention / 1e9


def quartiles(ratios: list[float]) -> str:
    return f"quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios)) // 4]:.3f}, {len(ratios)} pairs"


def training_rounds(model: nn.Module, stream: torch.Tensor, block: int) -> dict[str, list[float]]:
    """Seconds per step of flyscale's trainer and of nanoGPT's loop, and the matmul rate of
    `block` products, ROUNDS interleaved rounds of each after one not counted."""
    cfg = TrainConfig(epochs=1, batch_size=BATCH, seed=0)
    packed = packed_sequences(stream)
    x_val, rows = packed[-BATCH:], STEPS * BATCH
    slices = itertools.cycle(range(0, len(packed) - BATCH - rows, rows))  # a fresh slice of the corpus a round
    g = torch.Generator().manual_seed(0)
    runs = {
        "flyscale": lambda: [flyscale_steps(model, packed[(s := next(slices)) : s + rows], x_val, cfg)],
        "nanoGPT": lambda: [nanogpt_steps(model, stream, cfg, g)],
        "matmul": lambda: [matmul_gflops(block)],
    }
    interleaved(runs, 1)  # lazy inits, the allocator, oneDNN's caches
    return interleaved(runs, ROUNDS)


def report_training(t: dict[str, list[float]]) -> None:
    ours, plain = t["flyscale"], t["nanoGPT"]
    paired = paired_ratios(ours, plain)
    median, fastest = statistics.median(paired), min(ours) / min(plain)
    cfg = TrainConfig()
    print(
        f"  training, {ROUNDS} rounds of {STEPS} steps of {BATCH} x {CONTEXT} tokens; AdamW fused=True (flyscale's "
        f"make_optimizer and the plain loop alike), lr {cfg.lr:g}, weight decay {cfg.weight_decay:g} on every parameter"
    )
    for name, times in (("flyscale (ddp, world size 1)", ours), ("nanoGPT's loop", plain)):
        print(
            f"    {name:<30} {statistics.median(times) * 1000:6.1f} ms/step median, {min(times) * 1000:6.1f} fastest"
            f"   {BATCH * CONTEXT / statistics.median(times):7.0f} tokens/s median"
        )
    verdict = "met" if median <= TRAIN_GOAL else "NOT met"
    print(
        f"    flyscale / nanoGPT: paired ratios' median {median:.3f} ({quartiles(paired)})   fastest's ratio "
        f"{fastest:.3f}   (goal <= {TRAIN_GOAL:.2f} on the paired median: {verdict})"
    )


def report_compute(t: dict[str, list[float]], flops: tuple[float, float], torch_alone: tuple[float, float]) -> None:
    (gflop, attention), peak = flops, t["matmul"]
    achieved = [gflop / s for s in t["flyscale"]]
    print(
        f"  compute: {gflop:.2f} GFLOP a step (forward+backward, FlopCounterMode), attention {attention:.2f} of them "
        f"({attention / gflop:.1%}); torch's counter alone: {torch_alone[0]:.2f} GFLOP, attention {torch_alone[1]:.2f}"
    )
    print(
        f"    flyscale's whole step (AdamW's update uncounted) {statistics.median(achieved):6.1f} GFLOP/s median, "
        f"{max(achieved):6.1f} fastest   matmul {N}^2 {statistics.median(peak):6.1f} median, {max(peak):6.1f} "
        f"fastest   fraction of the peak {statistics.median(achieved) / statistics.median(peak):.3f} (medians), "
        f"{max(achieved) / max(peak):.3f} (fastest); printed, no goal"
    )


def bare_generate(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The plainest greedy loop: the last CONTEXT ids in, the likeliest next one appended."""
    with torch.inference_mode():
        for _ in range(n):
            logits = model(ids[:, -CONTEXT:])[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids


def generation_seconds(generators: dict[str, Callable[[int], Any]], tokens: int, rounds: int) -> dict[str, list[float]]:
    """Seconds each generator takes to make `tokens` tokens, interleaved rounds, after one untimed
    call each. A generator is any callable that generates n tokens: the registered MLflow model's
    predict, wrapped so, is one more entry."""

    def timed(fn: Callable[[int], Any]) -> Callable[[], list[float]]:
        def run() -> list[float]:
            start = time.perf_counter()
            fn(tokens)
            return [time.perf_counter() - start]

        return run

    for fn in generators.values():
        fn(tokens)
    return interleaved({name: timed(fn) for name, fn in generators.items()}, rounds)


def served(model: nn.Module, folder: str) -> Callable[[str, int], list[str]]:
    """The model as the register task logs it (flyscale/tracking/model_log.py model_args: its code,
    weights, spec, tokenizer, signature and params), saved to `folder` and loaded back with
    mlflow.pyfunc.load_model: its predict(prompt, params) is what a user of the registered model calls."""
    import mlflow

    from flyscale.config import ObjectiveConfig
    from flyscale.model import save_state
    from flyscale.tracking.model_log import ModelFiles, model_args
    from flyscale.tracking.model_spec import spec_json

    spec = spec_json(
        ModelConfig(name="gpt", options=OPTIONS), sequences_info(), None, ObjectiveConfig("language_modeling")
    )
    files = ModelFiles(save_state(model, "bench_gpt.pt"), spec, ByteTokenizer().to_json())
    path = str(Path(folder) / "model")
    mlflow.pyfunc.save_model(path, **model_args(files, "model", folder))
    loaded = mlflow.pyfunc.load_model(path)
    return lambda prompt, n: loaded.predict(prompt, params={"max_new_tokens": n, "temperature": 0.0})


def generation(model: nn.Module, stream: torch.Tensor) -> None:
    """Part 3: flyscale.api.generate and the registered model's predict against the bare loop,
    batch 1, greedy."""
    prompt = stream[None, :PROMPT]
    text = ByteTokenizer().decode(prompt[0].tolist())  # the same ids, as the served model's string
    model.eval()
    predict = served(model, tempfile.mkdtemp(prefix="bench-gpt-"))
    generators: dict[str, Callable[[int], Any]] = {
        "flyscale.api.generate": lambda n: generate(model, prompt, n, CONTEXT, temperature=0),
        "registered model's predict": lambda n: predict(text, n),
        "bare loop": lambda n: bare_generate(model, prompt, n),
    }
    bare = generators["bare loop"](NEW_TOKENS)
    same = torch.equal(generators["flyscale.api.generate"](NEW_TOKENS), bare)
    # The served model reads the prompt as text: the same tokens only where the text encodes back to them.
    same &= ByteTokenizer().decode(bare[0, PROMPT:].tolist()) == generators["registered model's predict"](NEW_TOKENS)[0]
    t = generation_seconds(generators, NEW_TOKENS, GENERATION_ROUNDS)
    base = t["bare loop"]
    print(
        f"  generation, batch 1, prompt {PROMPT} tokens, {NEW_TOKENS} new (greedy, window {CONTEXT}), "
        f"same tokens: {'yes' if same else 'NO'}"
    )
    for name, times in t.items():
        rate = NEW_TOKENS / statistics.median(times)
        line = f"    {name:<30} {rate:6.1f} tokens/s median, {NEW_TOKENS / min(times):6.1f} fastest"
        if times is not base:
            speed = sorted(b / c for b, c in zip(base, times))  # paired rates' ratios
            median = statistics.median(speed)
            verdict = "met" if median >= GENERATION_GOAL else "NOT met"
            line += (
                f"   speed over the bare loop: paired median {median:.3f} ({quartiles(speed)})   fastest's "
                f"{min(base) / min(times):.3f}   (goal >= {GENERATION_GOAL:.2f}: {verdict})"
            )
        print(line)


def main() -> None:
    torch.set_num_threads(THREADS)
    stream = corpus()
    model = gpt_model()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"bench_gpt: the GPT plugin ({OPTIONS['layers']} layers, width {OPTIONS['width']}, {OPTIONS['heads']} heads, "
        f"{params / 1e6:.2f}M parameters) on {len(stream) / 1e6:.2f}M byte tokens of the pydoc corpus, "
        f"{THREADS} threads, against nanoGPT's loops"
    )
    sample = packed_sequences(stream)[:BATCH]
    flops = step_flops(model, sample, CPU_ATTENTION)
    torch_alone = step_flops(model, sample)
    t = training_rounds(model, stream, block=max(1, round(flops[0] * STEPS / PRODUCT_GFLOP)))  # a round's time
    report_training(t)
    report_compute(t, flops, torch_alone)
    generation(model, stream)


if __name__ == "__main__":
    main()
