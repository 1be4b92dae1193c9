"""The quantized model against the fp32 one, measured side by side in one process: accuracy,
size and latency, the numbers the `quantization` gate judges and MLflow records."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from flyscale.evaluate.latency import BATCH_SIZES, MIN_REPEATS, LatencyReport, measure_side_by_side
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.plugin.records import cost_name, costed

# What "smaller and faster" means for an int8 twin to be worth a second model to serve: a file at
# least 10 % smaller, and at least 5 % faster by the geometric mean over the batch sizes timed.
# Timings on a shared machine move by a few percent between repeats, so 1.01x is no speed-up.
PAYS_SMALLER, PAYS_FASTER = 1.10, 1.05


@dataclass
class Comparison:
    """fp32 against int8 on the same test split and the same synthetic latency inputs."""

    quantizer: str = ""
    accuracy_drop: float = 0.0  # fp32 accuracy - int8 accuracy (a classifier's)
    size_ratio: float = 0.0  # fp32 size / int8 size
    fp32_latency: LatencyReport = field(default_factory=LatencyReport)
    int8_latency: LatencyReport = field(default_factory=LatencyReport)
    # What int8 costs on each of the objective's metrics, in the metric's units, positive when int8
    # is worse: {"perplexity_increase": 0.03, "r2_drop": 0.001}.
    costs: dict[str, float] = field(default_factory=dict)
    unit: str = "batch"  # what one timed call makes: a "batch" of predictions, or a generated "token"
    # Whether the int8 model earns its place beside fp32 (smaller and faster, `pays`), and in words
    # why or why not, with any other quantizer tried; an int8 model that does not pay is not
    # registered as the twin.
    pays: bool = True
    verdict: str = ""

    def judge(self, tried: str = "") -> Comparison:
        """Set `pays` from the measurements: smaller on disk, and faster by the geometric mean of
        the speed-ups over the batch sizes timed (one batch size's noise does not decide it), each
        by a margin (PAYS_SMALLER, PAYS_FASTER).
        `tried`: what another quantizer did, to say beside it."""
        speedups = list(self.speedup().values())
        mean = math.prod(speedups) ** (1 / len(speedups)) if speedups else 0.0
        spread = f"{min(speedups):.2f}-{max(speedups):.2f}x" if speedups else "not timed"
        sizes = [b for b in self.fp32_latency.batch_sizes]
        where = f"batch {min(sizes)}-{max(sizes)}" if sizes else "no batch"
        smaller, faster = self.size_ratio >= PAYS_SMALLER, mean >= PAYS_FASTER
        self.pays = smaller and faster
        said = (
            f"{self.quantizer}: {self.size_ratio:.2f}x smaller, {mean:.2f}x the speed (geometric mean of {spread} over "
            f"{where})"
        )
        if self.pays:
            self.verdict = f"pays: {said}"
        else:
            lacks = " and ".join(w for w, ok in (("smaller", smaller), ("faster", faster)) if not ok)
            self.verdict = f"does not pay, not {lacks}: {said}"
        if tried:
            self.verdict += f"; {tried}"
        return self

    def speedup(self) -> dict[int, float]:
        """{batch size: fp32 p50 / int8 p50}."""
        fp32 = dict(zip(self.fp32_latency.batch_sizes, self.fp32_latency.p50_ms))
        return {
            b: fp32[b] / p50
            for b, p50 in zip(self.int8_latency.batch_sizes, self.int8_latency.p50_ms)
            if b in fp32 and p50 > 0
        }

    def scalars(self) -> dict[str, float]:
        """What gates see and MLflow records: both models' latency, the speed-ups, size and drop."""
        return {
            **self.fp32_latency.scalars(),
            **self.int8_latency.scalars("int8_"),
            **{f"int8_speedup_b{b}": s for b, s in self.speedup().items()},
            "int8_size_ratio": self.size_ratio,
            "int8_pays": float(self.pays),
            **({"int8_accuracy_drop": self.accuracy_drop} if not self.costs else {}),
            **{f"int8_{k}": v for k, v in self.costs.items()},
        }

    def lines(self) -> list[str]:
        """One line per batch size, for the run summary."""
        speedup = self.speedup()
        rows = zip(
            self.fp32_latency.batch_sizes,
            self.fp32_latency.p50_ms,
            self.fp32_latency.p99_ms,
            self.int8_latency.p50_ms,
            self.int8_latency.p99_ms,
        )
        out = []
        for b, f50, f99, i50, i99 in rows:
            noise = max(self.fp32_latency.noisy(b) or 0.0, self.int8_latency.noisy(b) or 0.0)
            ratio = (
                f"{speedup.get(b, 0):.2f}x"
                if not noise
                else f"no ratio: too noisy to trust (p50 moved {noise:.0%} between repeated measurements)"
            )
            per = " per generated token" if self.unit == "token" else ""
            calls = min(self.fp32_latency.calls(b), self.int8_latency.calls(b))
            few = f" ({calls} timed calls: a p99 of so few is near the slowest)" if calls < MIN_REPEATS else ""
            out.append(
                f"batch {b:>3}{per}: fp32 p50 {f50:.3f} ms p99 {f99:.3f} ms   int8 p50 {i50:.3f} ms p99 {i99:.3f} ms   "
                f"{ratio}{few}"
            )
        return out


def costs(fp32: EvalMetrics, int8: EvalMetrics, metrics: dict[str, bool]) -> dict[str, float]:
    """How much worse int8 is on each metric (positive: worse), named by which way is worse:
    `<metric>_drop` for one where higher is better, `<metric>_increase` for one where lower is."""
    a, b = fp32.scalars(), int8.scalars()
    return {
        cost_name(name, up): a[name] - b[name] if up else b[name] - a[name]
        for name, up in costed(metrics).items()
        if name in a and name in b
    }


def compare(
    fp32_model: nn.Module,
    int8_model: nn.Module,
    quantizer: str,
    fp32: EvalMetrics,
    int8: EvalMetrics,
    n_features: int | list[int],
    metrics: dict[str, bool] | None = None,
    make_input: Callable[[int, torch.Generator], torch.Tensor] | None = None,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    unit: str = "batch",
) -> Comparison:
    """Time both models side by side (interleaved, so machine drift hits both) and compare.

    `metrics` ({name: higher is better}, the objective's) are compared beyond a classifier's
    accuracy; `make_input` and `batch_sizes` say what one timed call is given (a language
    model's: a window of token ids, one generated token a call, `unit` "token")."""
    reports = measure_side_by_side(
        {"fp32": fp32_model, "int8": int8_model}, n_features, batch_sizes, budget_s=0.5, make_input=make_input
    )
    return Comparison(
        quantizer=quantizer,
        accuracy_drop=fp32.accuracy - int8.accuracy,
        costs=costs(fp32, int8, metrics or {}) if not fp32.classifier else {},
        unit=unit,
        size_ratio=fp32.size_bytes / max(int8.size_bytes, 1),
        fp32_latency=reports["fp32"],
        int8_latency=reports["int8"],
    )
