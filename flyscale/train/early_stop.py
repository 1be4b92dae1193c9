"""Early stopping, judged from the epochs' metrics alone: the same on every rank (each epoch's
validation sums are reduced over all of them), and the same after a resume (the finished
epochs travel in the checkpoint), so no rank and no restart can decide differently."""

from __future__ import annotations

from dataclasses import dataclass

from flyscale.config.sections import EarlyStoppingConfig
from flyscale.train.telemetry import EpochMetrics


@dataclass(frozen=True)
class Verdict:
    best: int  # index of the best epoch so far
    stale: int  # epochs since it
    stop: bool  # patience has run out


def judge(epochs: list[EpochMetrics], cfg: EarlyStoppingConfig) -> Verdict:
    """Where the epochs so far stand: the best by `cfg.metric`, and whether to stop."""
    if not epochs:
        raise ValueError("early stopping judges the epochs trained so far, and there are none")
    best = 0
    for i, m in enumerate(epochs[1:], start=1):
        if cfg.improves(value(m, cfg), value(epochs[best], cfg)):
            best = i
    stale = len(epochs) - 1 - best
    return Verdict(best, stale, stale >= cfg.patience)


def value(m: EpochMetrics, cfg: EarlyStoppingConfig) -> float:
    return float(getattr(m, cfg.metric))


def sentence(epochs: list[EpochMetrics], cfg: EarlyStoppingConfig, planned: int) -> str:
    """What early stopping did, for the summary and MLflow: which epoch was kept and why."""
    v = judge(epochs, cfg)
    kept = f"kept epoch {v.best + 1}'s weights ({cfg.metric} {value(epochs[v.best], cfg):.4f})"
    if v.stop:
        return (
            f"stopped after epoch {len(epochs)} of {planned}: {cfg.metric} did not improve by more than "
            f"{cfg.min_delta:g} for {cfg.patience} epoch{'s' if cfg.patience > 1 else ''}; {kept}"
        )
    return f"trained all {len(epochs)} epochs; {kept}"
