"""Built-in evaluation gates: what a model must show before it may become champion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from plugins.protocols import GateVerdict

METRICS = ("accuracy", "macro_f1")


@dataclass
class MinMetricOptions:
    metric: str = "accuracy"
    threshold: float = 0.95

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")


class MinMetric:
    """Pass when the test metric reaches a fixed threshold."""

    options_type = MinMetricOptions

    def check(
        self, metrics: Mapping[str, float], options: MinMetricOptions, champion: Mapping[str, float] | None
    ) -> GateVerdict:
        value = metrics[options.metric]
        passed = value >= options.threshold
        rel = ">=" if passed else "<"
        return GateVerdict(
            "min_metric", passed, f"test {options.metric} {value:.4f} {rel} threshold {options.threshold:.4f}"
        )


min_metric = MinMetric()
