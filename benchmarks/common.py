"""What the benchmarks share: the data, the models measured, interleaved timing, the report."""

from __future__ import annotations

import statistics
from typing import Callable

from flyscale import data
from flyscale.config import AugmentConfig, DataConfig, ModelConfig
from flyscale.training import TrainData

# A tiny step (the default MLP: ~1.5 ms at batch 32) shows fixed per-step overheads at their
# worst; the CNN preset has ten times the compute per step, closer to real models.
MODELS = {
    "mlp (default)": ModelConfig(),
    "cnn (digits-cnn preset)": ModelConfig(name="cnn", options={"channels": [16, 32], "hidden": 128}),
}


def digits_x3() -> tuple[TrainData, object]:
    """Digits' training split with two augmented copies (3501 rows), and its validation split."""
    frame, info = data.load(DataConfig())
    train, val, _ = data.split(frame, DataConfig())
    train = data.augment(train, info, AugmentConfig(names=["shift", "noise"], copies=2))
    return data.train_data(train, val, info), info


def interleaved(runs: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, float]:
    """Median per-epoch seconds of each run, alternating them so machine drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name] += run()
    return {name: statistics.median(t) for name, t in times.items()}


def report(title: str, baseline: str, candidates: list[str], rows: dict[str, dict[str, float]], goal: float) -> None:
    """One line per model and candidate: both timings and candidate/baseline."""
    print(title)
    for model, t in rows.items():
        for candidate in candidates:
            ratio = t[candidate] / t[baseline]
            verdict = f"(goal <= {goal:.2f}: {'met' if ratio <= goal else 'NOT met'})"
            print(
                f"  {model:<24} {baseline} {t[baseline] * 1000:7.1f} ms/epoch   {candidate} "
                f"{t[candidate] * 1000:7.1f} ms/epoch   ratio {ratio:.3f} {verdict}"
            )
