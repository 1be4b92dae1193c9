"""`acme_min_f1`: a model must reach a macro-F1 threshold on the test split."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class MinF1Options:
    threshold: float = 0.9

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")


@dataclass
class Verdict:
    """Same fields as flyscale's GateVerdict (name, passed, reason): structural typing."""

    name: str
    passed: bool
    reason: str


class MinF1:
    """Pass when test macro-F1 >= threshold. Ignores the champion: an absolute bar."""

    options_type = MinF1Options

    def check(
        self, metrics: Mapping[str, float], options: MinF1Options, champion: Mapping[str, float] | None
    ) -> Verdict:
        f1 = metrics["macro_f1"]
        passed = f1 >= options.threshold
        return Verdict(
            "acme_min_f1", passed, f"test macro-F1 {f1:.4f} {'>=' if passed else '<'} {options.threshold:.4f}"
        )


min_f1 = MinF1()
