"""Built-in evaluation gates: what a model must show before it may become champion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from flyscale.api import GateVerdict

METRICS = ("accuracy", "macro_f1")


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")


@dataclass
class MinMetricOptions:
    metric: str = "accuracy"
    threshold: float = 0.95

    def __post_init__(self):
        _check_metric(self.metric)
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


@dataclass
class BeatsChampionOptions:
    metric: str = "accuracy"
    min_improvement: float = 0.0  # how much better than the champion a candidate must be

    def __post_init__(self):
        _check_metric(self.metric)
        if self.min_improvement < 0:
            raise ValueError(f"min_improvement must be >= 0, got {self.min_improvement}")


class BeatsChampion:
    """Pass when the candidate is better than the current champion (the first model passes)."""

    options_type = BeatsChampionOptions

    def check(
        self, metrics: Mapping[str, float], options: BeatsChampionOptions, champion: Mapping[str, float] | None
    ) -> GateVerdict:
        value = metrics[options.metric]
        if champion is None:
            return GateVerdict("beats_champion", True, f"no champion yet; test {options.metric} {value:.4f}")
        if options.metric not in champion:
            return GateVerdict(
                "beats_champion", False, f"champion v{champion.get('version', 0):.0f} has no {options.metric} to compare"
            )
        bar = champion[options.metric] + options.min_improvement
        passed = value > bar
        return GateVerdict(
            "beats_champion",
            passed,
            f"test {options.metric} {value:.4f} {'>' if passed else '<='} champion v{champion.get('version', 0):.0f} "
            f"{champion[options.metric]:.4f} + {options.min_improvement:.4f}",
        )


beats_champion = BeatsChampion()
