"""int8 against fp32 on the built-in models: latency at batch 1, 64 and 1024, size, accuracy.

Each model is trained briefly on digits (flyscale's trainer, seed fixed), quantized the way the
quantize task does it (static: calibrated on the first training rows), and timed side by side
in one process: every repetition calls each model once, in turn, so machine drift hits all
alike, and the median is reported. Goals (met or NOT met, as measured): at batch 64 at least
1.5x faster, at least 3.5x smaller, and at most 0.01 lower test accuracy.

Beside each model, the ceiling of any int8 path on this CPU: its Linear layers timed one by one
with the bare int8 kernel (input already quantized) against fp32. Where it is below 1.5x, the
speed-up goal is out of reach of every quantizer, as it is for the default MLP on AVX2 without
VNNI: a 64x256 -> 128 int8 product there is no faster than MKL's fp32.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch
from torch import nn

from flyscale import model as artifacts
from flyscale.config import DataConfig, ModelConfig, QuantizeConfig, TrainConfig
from flyscale.data import source as data
from flyscale.data.split import split
from flyscale.data.tensors import to_tensors
from flyscale.evaluate.metrics import evaluate, state_dict_bytes
from flyscale.evaluate.quantize import quantize
from flyscale.train.batches import train_data
from flyscale.train.distributed import DistContext
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

EPOCHS = 5
CALIBRATION_ROWS, CALIBRATION_BATCH = 512, 64  # as the quantize task takes them
BATCHES = (1, 64, 1024)  # 1024: where int8's arithmetic starts to outweigh its per-call overheads here
REPEATS = {1: 600, 64: 200, 1024: 30}  # timed calls per model and batch size, interleaved
WARMUP = 20
GOAL_SPEEDUP, GOAL_SMALLER, GOAL_DROP = 1.5, 3.5, 0.01

CNN = ModelConfig(name="cnn", options={"channels": [16, 32], "hidden": 128})
# (label, model config, quantizers measured, the quantizer held to the goals)
CASES = [
    ("mlp (default)", ModelConfig(), ["dynamic_int8", "static_int8"], "dynamic_int8"),
    ("cnn (digits-cnn preset)", CNN, ["static_int8", "dynamic_int8"], "static_int8"),
    # Where int8 pays on these CPUs: layers wide enough that arithmetic, not per-call overhead, dominates.
    (
        "wide mlp (hidden 1024 x 2)",
        ModelConfig(options={"hidden": [1024, 1024]}),
        ["dynamic_int8", "static_int8"],
        "dynamic_int8",
    ),
]


@torch.no_grad()
def latencies(models: dict[str, nn.Module], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each model on `x`, the calls interleaved."""
    for model in models.values():
        for _ in range(WARMUP):
            model(x)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.no_grad()
def kernel_ceiling(model: nn.Module, batch: int, repeats: int = 300) -> float:
    """fp32 time over int8 time of the model's Linear layers at `batch`, each layer by itself,
    int8 as the bare fbgemm kernel on an input already quantized: no quantize, dequantize or
    dispatch of a whole model. No int8 path (dynamic, static, another library on the same
    kernels) runs these layers faster than this on this CPU."""
    f32: list[float] = []
    q8: list[float] = []
    for layer in (m for m in model.modules() if isinstance(m, nn.Linear)):
        x = torch.randn(batch, layer.in_features)
        scales = layer.weight.abs().amax(1).double().clamp(min=1e-8) / 127
        with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated, and still what fbgemm runs
            warnings.simplefilter("ignore")
            qx = torch.quantize_per_tensor(x, 0.05, 64, torch.quint8)
            qw = torch.quantize_per_channel(
                layer.weight, scales, torch.zeros(layer.out_features, dtype=torch.long), 0, torch.qint8
            )
        packed = torch.ops.quantized.linear_prepack(qw, layer.bias)
        lat = latencies(
            {
                "fp32": lambda _, x=x, layer=layer: layer(x),
                "int8": lambda _, qx=qx, packed=packed: torch.ops.quantized.linear(qx, packed, 0.1, 64),
            },
            x,
            repeats,
        )
        f32.append(lat["fp32"])
        q8.append(lat["int8"])
    return sum(f32) / sum(q8) if q8 else float("nan")


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    frame, info = data.load(DataConfig())
    train, val, test = split(frame, DataConfig())
    d = train_data(train, val, info)
    x_test, y_test = to_tensors(test, info)
    calibration = list(d.x_train[:CALIBRATION_ROWS].split(CALIBRATION_BATCH))
    cfg = TrainConfig(epochs=EPOCHS, seed=0)
    print(
        f"int8 vs fp32: digits, trained {EPOCHS} epochs, test split {len(y_test)} rows, "
        f"{torch.get_num_threads()} threads, engine {torch.backends.quantized.engine}; "
        f"latency = median of {' / '.join(f'{REPEATS[b]} (batch {b})' for b in BATCHES)} interleaved calls; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for label, model_cfg, quantizers, goal_quantizer in CASES:
        torch.manual_seed(0)
        fp32 = ddp(artifacts.build_model(model_cfg, info), d, cfg, DistContext(), DDPOptions()).model.eval()
        models = {"fp32": fp32}
        models.update({q: quantize(fp32, QuantizeConfig(name=q), calibration) for q in quantizers})
        acc = {name: evaluate(m, x_test, y_test, info.num_classes).accuracy for name, m in models.items()}
        size = {name: state_dict_bytes(m) for name, m in models.items()}
        lat = {b: latencies(models, d.x_train[:b], REPEATS[b]) for b in BATCHES}
        print(f"  {label}")
        print(
            f"    {'':<13} {'accuracy':>8} {'b1 us':>8} {'b64 us':>8} {'b1024 us':>9} {'KiB':>7}"
            "   speed-up b1 / b64 / b1024   smaller   drop"
        )
        for name in models:
            row = (
                f"    {name:<13} {acc[name]:8.4f} {lat[1][name] * 1e6:8.1f} {lat[64][name] * 1e6:8.1f} "
                f"{lat[1024][name] * 1e6:9.1f} {size[name] / 1024:7.1f}"
            )
            if name != "fp32":
                s1, s64, s1024 = (lat[b]["fp32"] / lat[b][name] for b in BATCHES)
                row += (
                    f"   {s1:8.2f}x / {s64:.2f}x / {s1024:.2f}x   {size['fp32'] / size[name]:6.2f}x"
                    f"   {acc['fp32'] - acc[name]:+.4f}"
                )
            print(row)
        ceiling = kernel_ceiling(fp32, 64)
        print(
            f"    ceiling: fbgemm's int8 kernel alone on this model's Linear layers at batch 64 (input already "
            f"quantized): {ceiling:.2f}x fp32"
        )
        q = goal_quantizer
        speedup, smaller, drop = lat[64]["fp32"] / lat[64][q], size["fp32"] / size[q], acc["fp32"] - acc[q]
        print(
            f"    goals for {q}: b64 speed-up {speedup:.2f}x >= {GOAL_SPEEDUP}x {_verdict(speedup >= GOAL_SPEEDUP)}; "
            f"{smaller:.2f}x smaller >= {GOAL_SMALLER}x {_verdict(smaller >= GOAL_SMALLER)}; "
            f"accuracy drop {drop:+.4f} <= {GOAL_DROP} {_verdict(drop <= GOAL_DROP)}"
        )


if __name__ == "__main__":
    main()
