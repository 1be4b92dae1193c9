"""int8 against fp32, both served the same way: ONNX Runtime sessions of the exported fp32 file
and of the int8 file each quantizer makes of it, at batch 1, 64 and 1024, with the test accuracy
and the file sizes.

Each digits model is trained briefly (flyscale's trainer, seed fixed), exported as the export
stage does, quantized as the quantize stage does (static: calibrated on the first 512 training
rows), and timed side by side in one process: every repetition calls each session once, in
turn, so machine drift hits all alike; the median is reported. The GPT (random weights: speed
does not depend on what was learnt) is timed on 64-token windows.

Goal, per preset, for the quantizer the preset uses: int8 at least as fast as fp32 at batch 64
(or that quantizer should not be the preset's), at least 3x smaller, at most 0.01 accuracy lost.
The deprecated torch.ao quantizers are printed beside them, in torch eager, for reference.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_onnx import SEQ, TOKENS  # the same 64-token GPT input as the ONNX benchmark
from flyscale import model as artifacts
from flyscale.config import DataConfig, ModelConfig, QuantizeConfig, TrainConfig
from flyscale.data import source as data
from flyscale.data.prepare import prepare_table, prepared_frames
from flyscale.data.tensors import to_tensors
from flyscale.evaluate.metrics import evaluate, state_dict_bytes
from flyscale.evaluate.quantize import quantize, quantize_onnx
from flyscale.export import onnx
from flyscale.train import trainer
from flyscale.train.batches import train_data
from flyscale.train.distributed import DistContext
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

EPOCHS = 5
CALIBRATION_ROWS, CALIBRATION_BATCH = 512, 64  # as the quantize task takes them
BATCHES = (1, 64, 1024)
REPEATS = {1: 400, 64: 150, 1024: 20}  # timed calls per model and batch size, interleaved
WARMUP = 10
GOAL_SPEEDUP, GOAL_SMALLER, GOAL_DROP = 1.0, 3.0, 0.01

CNN = ModelConfig(name="cnn", options={"channels": [16, 32], "hidden": 128, "dropout": 0.1})
# (label, model config, ONNX quantizers measured, the preset's quantizer, deprecated torch ones)
CASES = [
    (
        "mlp (digits-mlp, the default)",
        ModelConfig(),
        ["dynamic_int8", "static_int8"],
        "dynamic_int8",
        ["torch_dynamic_int8"],
    ),
    ("cnn (digits-cnn)", CNN, ["dynamic_int8", "static_int8"], "dynamic_int8", ["torch_static_int8"]),
    (
        "gpt (text-gpt: 4 x 128, 64 tokens)",
        ModelConfig(name="gpt", options={"layers": 4, "heads": 4, "width": 128}),
        ["dynamic_int8"],
        "dynamic_int8",
        [],
    ),
]


def latencies(models: dict[str, nn.Module], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each model on `x`, the calls interleaved."""
    with torch.inference_mode():
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


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    frame, info = data.load(DataConfig())
    train, val, test = prepared_frames(prepare_table(frame, DataConfig(), info))
    d = train_data(train, val, info)
    x_test, y_test = to_tensors(test, info)
    calibration = list(d.x_train[:CALIBRATION_ROWS].split(CALIBRATION_BATCH))
    cfg = TrainConfig(epochs=EPOCHS, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    print(
        f"int8 vs fp32, served the same way (ONNX Runtime, CPU): digits trained {EPOCHS} epochs, test split "
        f"{len(y_test)} rows, {torch.get_num_threads()} threads; latency = median of "
        f"{' / '.join(f'{REPEATS[b]} (batch {b})' for b in BATCHES)} interleaved calls; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for label, model_cfg, quantizers, preset, deprecated in CASES:
        torch.manual_seed(0)
        text = model_cfg.name == "gpt"
        if text:
            fp32 = artifacts.build_model(model_cfg, TOKENS).eval()
            inputs = {b: torch.randint(0, 257, (b, SEQ)) for b in BATCHES}
            calib = [torch.randint(0, 257, (8, SEQ)).numpy()]
        else:
            fp32 = trainer.train(
                ddp, artifacts.build_model(model_cfg, info), d, cfg, DistContext(), DDPOptions()
            ).model.eval()
            inputs = {b: d.x_train[:b] if b <= len(d.x_train) else torch.randn(b, 64) for b in BATCHES}
            calib = [b.numpy() for b in calibration]
        path = onnx.export(fp32, inputs[64][:4], tmp / f"{label.split()[0]}.onnx")
        served: dict[str, nn.Module] = {"fp32": onnx.OnnxModule(path)}
        for q in quantizers:
            served[q] = onnx.OnnxModule(quantize_onnx(path, QuantizeConfig(name=q), calib))
        eager = {q: quantize(fp32, QuantizeConfig(name=q), calibration) for q in deprecated}
        size = {name: m.size_bytes() for name, m in served.items()} | {q: state_dict_bytes(m) for q, m in eager.items()}
        acc = (
            {}
            if text
            else {
                name: evaluate(m, x_test, y_test, info.num_classes).accuracy
                for name, m in {**served, **eager, "torch fp32": fp32}.items()
            }
        )
        lat = {b: latencies({**served, **eager, "torch fp32": fp32}, inputs[b], REPEATS[b]) for b in BATCHES}
        print(f"  {label}")
        print(
            f"    {'':<20} {'accuracy':>8} {'b1 us':>9} {'b64 us':>9} {'b1024 us':>10} {'KiB':>8}"
            "   speed-up b1 / b64 / b1024 vs ONNX fp32   smaller   drop"
        )
        for name in [*served, *eager, "torch fp32"]:
            a = f"{acc[name]:8.4f}" if acc else f"{'-':>8}"
            kib = f"{size[name] / 1024:8.1f}" if name in size else f"{'':>8}"
            row = f"    {name:<20} {a} {lat[1][name] * 1e6:9.1f} {lat[64][name] * 1e6:9.1f} {lat[1024][name] * 1e6:10.1f} {kib}"
            if name != "fp32":
                s1, s64, s1024 = (lat[b]["fp32"] / lat[b][name] for b in BATCHES)
                row += f"   {s1:8.2f}x / {s64:.2f}x / {s1024:.2f}x"
                if name in size:
                    row += f"            {size['fp32'] / size[name]:6.2f}x"
                if acc and name != "torch fp32":
                    row += f"   {acc['fp32'] - acc[name]:+.4f}"
            print(row)
        speedup, smaller = lat[64]["fp32"] / lat[64][preset], size["fp32"] / size[preset]
        drop = acc["fp32"] - acc[preset] if acc else 0.0
        print(
            f"    goals for {preset} (the preset's): b64 speed-up {speedup:.2f}x >= {GOAL_SPEEDUP}x "
            f"{_verdict(speedup >= GOAL_SPEEDUP)}; {smaller:.2f}x smaller >= {GOAL_SMALLER}x "
            f"{_verdict(smaller >= GOAL_SMALLER)}"
            + (f"; accuracy drop {drop:+.4f} <= {GOAL_DROP} {_verdict(drop <= GOAL_DROP)}" if acc else "")
        )


if __name__ == "__main__":
    main()
