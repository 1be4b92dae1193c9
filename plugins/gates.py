"""Built-in evaluation gates: what a model must show before it is published.

Every gate sees the same numbers: the candidate's test metrics (`accuracy`, `macro_f1`, `loss`,
`ece`, `size_bytes`, per-class `precision_class_<k>` / `recall_class_<k>`, `latency_p50_ms_b<n>`,
`latency_p99_ms_b<n>`, `throughput_b<n>`), the quantized model's under an `int8_` prefix, and the
quantization's own `int8_accuracy_drop`, `int8_speedup_b<n>` and `int8_size_ratio`. Whether a
number is better higher or lower is its nature (`flyscale.api.higher_is_better`): a loss or a
latency passes below its bound, an accuracy above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flyscale.api import GateVerdict, cost_name, higher_is_better


def _judged(metric: str) -> bool:
    """The metric's nature, with the int8 model's metrics judged like the fp32 ones."""
    return higher_is_better(metric.removeprefix("int8_"))


def _recorded(metrics: Mapping[str, float], metric: str, gate: str) -> GateVerdict | None:
    """A failed verdict when the metric was not recorded: a gate never passes on a missing number."""
    if metric in metrics:
        return None
    return GateVerdict(gate, False, f"no {metric} was recorded (recorded: {', '.join(sorted(metrics))})")


def _bounded(gate: str, metrics: Mapping[str, float], wanted, say) -> GateVerdict:
    """Every (metric, bound, higher is better, label) of `wanted` on the right side of its bound;
    `say(label, value, relation, bound, higher is better)` words each. A missing metric fails."""
    reasons, passed = [], True
    for metric, bound, up, what in wanted:
        missing = _recorded(metrics, metric, gate)
        if missing is not None:
            return missing
        value = metrics[metric]
        ok = value >= bound if up else value <= bound
        passed &= ok
        reasons.append(say(what, value, (">=" if ok else "<") if up else ("<=" if ok else ">"), bound, up))
    return GateVerdict(gate, passed, "; ".join(reasons))


@dataclass
class MinMetricOptions:
    metric: str = "accuracy"
    threshold: float = 0.95
    # More bounds at once, {metric: bound}, e.g. {loss: 0.3, latency_p99_ms_b64: 5.0}; each judged by its nature.
    thresholds: dict = field(default_factory=dict)

    def __post_init__(self):
        for metric, bound in self.bounds().items():
            _judged(metric)  # an unknown metric fails here, naming what is known
            if metric.removeprefix("int8_") in ("accuracy", "macro_f1", "ece") and not 0.0 <= bound <= 1.0:
                raise ValueError(f"threshold must be in [0, 1] for {metric}, got {bound}")

    def bounds(self) -> dict[str, float]:
        return {self.metric: float(self.threshold), **{k: float(v) for k, v in self.thresholds.items()}}


class MinMetric:
    """Pass when every bounded metric is on the right side of its bound (>= or <=, by its nature)."""

    options_type = MinMetricOptions

    def reads(self, options: MinMetricOptions) -> list[str]:
        return list(options.bounds())

    def check(
        self, metrics: Mapping[str, float], options: MinMetricOptions, champion: Mapping[str, float] | None
    ) -> GateVerdict:
        reasons, passed = [], True
        for metric, bound in options.bounds().items():
            missing = _recorded(metrics, metric, "min_metric")
            if missing is not None:
                return missing
            value, up = metrics[metric], _judged(metric)
            ok = value >= bound if up else value <= bound
            passed &= ok
            rel = (">=" if ok else "<") if up else ("<=" if ok else ">")
            reasons.append(f"test {metric} {value:.4f} {rel} threshold {bound:.4f}")
        return GateVerdict("min_metric", passed, "; ".join(reasons))


min_metric = MinMetric()


@dataclass
class BeatsChampionOptions:
    """MLflow's MetricThreshold semantics: the candidate must beat the champion by more than the
    absolute and/or relative change given; with neither, by anything at all."""

    metric: str = "accuracy"
    min_absolute_change: float | None = None
    min_relative_change: float | None = None  # of the champion's value: 0.01 is 1 %
    greater_is_better: bool | None = None  # None: by the metric's nature
    # The champion is scored on this run's test split through its registered model, so both are
    # judged on the same data. When it cannot be (its model does not load, or refuses this
    # split): "fail" fails closed; "recorded" compares the metrics it recorded on its own test
    # set, and says so; "pass" lets the candidate through.
    unscorable: str = "fail"
    # With unscorable: recorded, fail when those recorded metrics come from another test set.
    require_same_test_data: bool = False

    def __post_init__(self):
        if self.greater_is_better is None:
            _judged(self.metric)
        if self.unscorable not in UNSCORABLE:
            raise ValueError(f"unscorable must be one of {list(UNSCORABLE)}, got {self.unscorable!r}")
        for name in ("min_absolute_change", "min_relative_change"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    def up(self) -> bool:
        return self.greater_is_better if self.greater_is_better is not None else _judged(self.metric)


UNSCORABLE = ("fail", "recorded", "pass")


class BeatsChampion:
    """Pass when the candidate is better than the current champion (the first model passes),
    both scored on the candidate's test split."""

    options_type = BeatsChampionOptions
    compares_champion = True  # flyscale scores the champion on this run's test split first

    def reads(self, options: BeatsChampionOptions) -> list[str]:
        return [options.metric]

    def check(
        self, metrics: Mapping[str, float], options: BeatsChampionOptions, champion: Mapping[str, float] | None
    ) -> GateVerdict:
        m = options.metric
        missing = _recorded(metrics, m, "beats_champion")
        if missing is not None:
            return missing
        value = metrics[m]
        if champion is None:
            return GateVerdict("beats_champion", True, f"no champion yet; test {m} {value:.4f}")
        version = f"champion v{champion.get('version', 0):.0f}"
        if champion.get("other_kind"):
            return GateVerdict(
                "beats_champion",
                True,
                f"{version} is another kind of model, replaced (mlflow.replace_kind); test {m} {value:.4f}",
            )
        scored = champion.get("scored", 1.0)  # a caller that never scores it: its metrics as given
        if not scored and options.unscorable != "recorded":
            why = f"{version} could not be scored on this run's test split (the summary's test data line says why)"
            if options.unscorable == "pass":
                return GateVerdict("beats_champion", True, f"{why}; passed, as unscorable: pass says")
            return GateVerdict(
                "beats_champion",
                False,
                f"{why}: failing closed (option unscorable: recorded compares the metrics it recorded on its own "
                f"test set; pass lets this candidate through)",
            )
        if m not in champion:
            return GateVerdict("beats_champion", False, f"{version} has no {m} to compare")
        if options.require_same_test_data and not champion.get("same_test_data", 1.0):
            return GateVerdict(
                "beats_champion", False, f"{version} was tested on other data; require_same_test_data is set"
            )
        base = champion[m]
        gain = (value - base) if options.up() else (base - value)  # > 0: the candidate is better
        checks = []
        if options.min_absolute_change is not None:
            checks.append(
                (gain > options.min_absolute_change, f"by {gain:+.4f} (needs > {options.min_absolute_change:.4f})")
            )
        if options.min_relative_change is not None:
            rel = gain / abs(base) if base else float("inf") if gain > 0 else 0.0
            checks.append(
                (rel > options.min_relative_change, f"by {rel:+.2%} (needs > {options.min_relative_change:.2%})")
            )
        if not checks:
            checks.append((gain > 0, "strictly"))
        passed = all(ok for ok, _ in checks)
        better = "better" if passed else "not better"
        where = (
            "both on this run's test split"
            if scored and "scored" in champion
            else "the champion's as recorded, on the same test data"
            if champion.get("same_test_data", 1.0)
            else "the champion's as recorded, on OTHER test data"
        )
        return GateVerdict(
            "beats_champion",
            passed,
            f"test {m} {value:.4f} vs {version} {base:.4f}, {where}: {better} "
            + " and ".join(text for _, text in checks),
        )


beats_champion = BeatsChampion()


@dataclass
class QuantizationOptions:
    max_accuracy_drop: float = 0.01  # int8 may lose at most this much test accuracy (0.01: one point)
    # Any other objective: how much worse int8 may be on each named metric, in its own units,
    # e.g. {perplexity: 0.05} or {r2: 0.02} (read from int8_perplexity_increase, int8_r2_drop).
    # Given, it replaces max_accuracy_drop.
    max_worse: dict = field(default_factory=dict)
    min_speedup: float = 0.0  # fp32 p50 latency / int8 p50 latency at `batch_size`; 0: not bounded
    min_size_ratio: float = 0.0  # fp32 size / int8 size; 0: not bounded
    batch_size: int = 64  # where the speed-up is read

    def __post_init__(self):
        if not 0.0 <= self.max_accuracy_drop <= 1.0:
            raise ValueError(f"max_accuracy_drop must be in [0, 1], got {self.max_accuracy_drop}")
        for metric, bound in self.max_worse.items():
            _judged(metric)  # an unknown metric fails here, naming what is known
            if not isinstance(bound, int | float) or bound < 0:
                raise ValueError(f"max_worse.{metric} must be a number >= 0, got {bound!r}")
        for name in ("min_speedup", "min_size_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def costs(self) -> list[tuple[str, float]]:
        """(the recorded cost's name, its bound) of each metric int8 is held to."""
        if not self.max_worse:
            return [("int8_accuracy_drop", self.max_accuracy_drop)]
        return [(f"int8_{cost_name(m, _judged(m))}", float(b)) for m, b in self.max_worse.items()]


class Quantization:
    """Bound what int8 costs (accuracy) and demand what it is for (speed, size), measured side by
    side with the fp32 model in the same stage."""

    options_type = QuantizationOptions

    def reads(self, options: QuantizationOptions) -> list[str]:
        extra = [f"int8_speedup_b{options.batch_size}"] if options.min_speedup else []
        return [name for name, _ in options.costs()] + extra + (["int8_size_ratio"] if options.min_size_ratio else [])

    def check(
        self, metrics: Mapping[str, float], options: QuantizationOptions, champion: Mapping[str, float] | None
    ) -> GateVerdict:
        if metrics.get("int8_pays") == 0.0:  # not smaller and faster: no int8 twin, so nothing of it to bound
            return GateVerdict(
                "quantization",
                True,
                "int8 is not registered: it is not both smaller and faster (the int8 line says why)",
            )
        wanted = [(name, bound, False) for name, bound in options.costs()]
        if options.min_speedup:
            wanted.append((f"int8_speedup_b{options.batch_size}", options.min_speedup, True))
        if options.min_size_ratio:
            wanted.append(("int8_size_ratio", options.min_size_ratio, True))
        return _bounded(
            "quantization",
            metrics,
            [(m, bound, up, m.removeprefix("int8_").replace("_", " ")) for m, bound, up in wanted],
            lambda what, value, rel, bound, up: (
                f"{what} {value:+.4f} {rel} {'needed' if up else 'allowed'} {bound:.4f}"
            ),
        )


quantization = Quantization()


@dataclass
class ServedOptions:
    max_p99_ms: float = 100.0  # the served model's p99 latency at `at_concurrency` clients
    at_concurrency: int = 16  # one of serving.levels
    max_error: float = 0.0  # the share of requests not answered (HTTP status other than 200)
    min_throughput: float = 0.0  # requests a second at `at_concurrency`; 0: not bounded
    max_onnx_diff: float = 1e-4  # the export's largest difference from PyTorch on the test split

    def __post_init__(self):
        if self.max_p99_ms <= 0 or self.at_concurrency < 1:
            raise ValueError("max_p99_ms must be > 0 and at_concurrency >= 1")
        if not 0.0 <= self.max_error <= 1.0 or self.min_throughput < 0 or self.max_onnx_diff < 0:
            raise ValueError("max_error must be in [0, 1]; min_throughput and max_onnx_diff >= 0")

    def bounds(self) -> list[tuple[str, float, bool, str]]:
        """(metric, bound, higher is better, what a person reads) of each check."""
        k = f"served_c{self.at_concurrency}"
        out = [
            ("onnx_max_abs_diff", self.max_onnx_diff, False, "ONNX export's max difference from PyTorch"),
            (f"{k}_latency_p99_ms", self.max_p99_ms, False, f"served p99 at {self.at_concurrency} clients (ms)"),
            (f"{k}_error", self.max_error, False, f"requests failed at {self.at_concurrency} clients"),
        ]
        if self.min_throughput:
            out.append((f"{k}_throughput", self.min_throughput, True, f"requests/s at {self.at_concurrency} clients"))
        return out


class Served:
    """Hold the model as it will be served to a target: its export answered like the PyTorch
    model, and under the load test (serving.loadtest) it kept its p99 latency and lost no
    requests. Rollout safety: a version that fails is not promoted."""

    options_type = ServedOptions

    def reads(self, options: ServedOptions) -> list[str]:
        return [metric for metric, *_ in options.bounds()]

    def check(
        self, metrics: Mapping[str, float], options: ServedOptions, champion: Mapping[str, float] | None
    ) -> GateVerdict:
        return _bounded(
            "served",
            metrics,
            options.bounds(),
            lambda what, value, rel, bound, up: f"{what} {value:.4g} {rel} {bound:g}",
        )


served = Served()
