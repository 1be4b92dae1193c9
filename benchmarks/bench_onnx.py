"""ONNX Runtime against PyTorch eager: the same model, the same inputs, at batch 1, 64 and 1024.

The model is exported as the export stage exports it (`flyscale.export.onnx`: torch's dynamo
exporter, a dynamic batch dimension) and served by an ONNX Runtime session on the CPU with its
default options but spinning (off, so its idle threads do not slow torch's calls). Both run in this process, with the same threads (torch's intra-op count), and
every repetition calls each once, in turn, so machine drift hits both alike; the median is
reported. Goal: ONNX Runtime >= 1.5x PyTorch's throughput at batch 1 for the default MLP.
Printed for the CNN and a GPT (batch x 64 tokens).

Weights are the freshly initialised model's: speed does not depend on what was learnt.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig
from flyscale.export import onnx
from flyscale.model import build_model

GOAL = 1.5
BATCHES = (1, 64, 1024)
REPEATS = {1: 400, 64: 150, 1024: 20}
WARMUP = 10
SEQ = 64

DIGITS = DatasetInfo("digits", 10, [64], [f"p{i}" for i in range(64)])
IMAGES = DatasetInfo("digits", 10, [1, 8, 8], [f"p{i}" for i in range(64)])
TOKENS = DatasetInfo(
    "tokens",
    0,
    [SEQ + 1],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [SEQ + 1], range=[0, 256])],
    input_field="tokens",
)
MODELS = {
    "mlp (default)": (ModelConfig(), DIGITS, lambda b: torch.randn(b, 64)),
    "cnn": (ModelConfig(name="cnn"), IMAGES, lambda b: torch.randn(b, 64)),
    "gpt (4 x 128, 64 tokens)": (
        ModelConfig(name="gpt", options={"layers": 4, "heads": 4, "width": 128}),
        TOKENS,
        lambda b: torch.randint(0, 257, (b, SEQ)),
    ),
}


def _median_pair(model, runner, name: str, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds a call of (PyTorch, ONNX Runtime), alternated."""
    feed = {name: x.numpy()}
    torch_s, ort_s = [], []
    with torch.inference_mode():
        for i in range(WARMUP + repeats):
            start = time.perf_counter()
            model(x)
            mid = time.perf_counter()
            runner.run(None, feed)
            end = time.perf_counter()
            if i >= WARMUP:
                torch_s.append(mid - start)
                ort_s.append(end - mid)
    return statistics.median(torch_s), statistics.median(ort_s)


def main() -> None:
    torch.manual_seed(0)
    print(f"bench_onnx: ONNX Runtime / PyTorch eager throughput, one process, {torch.get_num_threads()} threads")
    for label, (cfg, info, make) in MODELS.items():
        model = build_model(cfg, info).eval()
        with tempfile.TemporaryDirectory() as tmp:
            path = onnx.export(model, make(4), Path(tmp) / "model.onnx")
            runner = onnx.session(path, spinning=False)  # spinning threads would slow torch's calls beside it
            name = runner.get_inputs()[0].name
            cells = []
            for b in BATCHES if "gpt" not in label else BATCHES[:2]:
                t, o = _median_pair(model, runner, name, make(b), REPEATS[b] if "gpt" not in label else 20)
                cells.append((b, t, o))
        shown = "   ".join(
            f"batch {b}: torch {t * 1e3:.3f} ms, onnxruntime {o * 1e3:.3f} ms = {t / o:.2f}x" for b, t, o in cells
        )
        print(f"  {label:<26} {shown}")
        if label.startswith("mlp"):
            ratio = cells[0][1] / cells[0][2]
            print(f"  {'':<26} batch 1: {ratio:.2f}x (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
