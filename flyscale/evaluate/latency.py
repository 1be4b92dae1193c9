"""Inference latency per batch size: p50, p99 and throughput, one model or several side by side."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

BATCH_SIZES = (1, 8, 64, 256)
MIN_REPEATS = 100  # a p99 from fewer calls is one outlier, not a percentile
MAX_REPEATS = 2000  # past this a small model's percentiles no longer move
WARMUP_S = 0.02  # per model and batch size: allocator, kernels' first-call costs, CPU caches
WARMUP_CALLS = 3  # at least this many, however slow
BLOCKS = 5  # the timed calls, in time order, cut into this many repeated measurements
# What reaching MIN_REPEATS may cost per batch size. A large model (a transformer at batch 256)
# would otherwise spend minutes of every run on 100 calls of each model; past this it stops at
# FEWEST_REPEATS or later, and the report says how few calls its p99 came from.
FLOOR_CAP_S = 2.0
FEWEST_REPEATS = 2 * BLOCKS  # enough for the spread between repeated measurements
NOISY_CV = 0.2  # a run-to-run spread of p50 above this: the number is not to be trusted


@dataclass
class LatencyReport:
    """Inference latency of one model, one entry per batch size (the lists are aligned)."""

    model: str = ""
    batch_sizes: list[int] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)  # samples/s at the p50 latency
    repeats: list[int] = field(default_factory=list)  # timed calls behind each entry
    # The spread of p50 between BLOCKS repeated measurements (the calls cut in time order), as a
    # coefficient of variation: how far the number would move if measured again.
    p50_cv: list[float] = field(default_factory=list)
    n_features: int = 0
    device: str = ""
    threads: int = 0  # torch's intra-op threads while measuring

    def add(self, batch_size: int, seconds: Sequence[float]) -> None:
        """Append one batch size's entry from its timed calls (seconds each)."""
        p50, p99 = (float(v) * 1000.0 for v in np.percentile(seconds, [50, 99]))
        self.batch_sizes.append(int(batch_size))
        self.p50_ms.append(p50)
        self.p99_ms.append(p99)
        self.throughput.append(batch_size / (p50 / 1000.0) if p50 > 0 else 0.0)
        self.repeats.append(len(seconds))
        self.p50_cv.append(spread(seconds))

    def scalars(self, prefix: str = "") -> dict[str, float]:
        """`latency_p50_ms_b<B>`, `latency_p99_ms_b<B>` and `throughput_b<B>` for each batch size B."""
        out: dict[str, float] = {}
        for b, p50, p99, tput in zip(self.batch_sizes, self.p50_ms, self.p99_ms, self.throughput):
            out[f"{prefix}latency_p50_ms_b{b}"] = p50
            out[f"{prefix}latency_p99_ms_b{b}"] = p99
            out[f"{prefix}throughput_b{b}"] = tput
        for b, cv in zip(self.batch_sizes, self.p50_cv):
            out[f"{prefix}latency_p50_cv_b{b}"] = cv
        return out

    def calls(self, batch_size: int) -> int:
        """The timed calls behind `batch_size`'s entry (0 for a batch size it has none of)."""
        return dict(zip(self.batch_sizes, self.repeats)).get(batch_size, 0)

    def noisy(self, batch_size: int) -> float | None:
        """The p50's spread at `batch_size` when it is too wide to trust (over NOISY_CV), else None."""
        for b, cv in zip(self.batch_sizes, self.p50_cv):
            if b == batch_size and cv > NOISY_CV:
                return cv
        return None

    def table(self) -> list[dict[str, float | int | str]]:
        """One row per batch size, for `mlflow.log_table(pandas.DataFrame(rows), ...)`."""
        return [
            {
                "model": self.model,
                "batch_size": b,
                "p50_ms": p50,
                "p99_ms": p99,
                "throughput_per_s": tput,
                "repeats": n,
                "p50_cv": cv,
                "device": self.device,
                "threads": self.threads,
            }
            for b, p50, p99, tput, n, cv in zip(
                self.batch_sizes, self.p50_ms, self.p99_ms, self.throughput, self.repeats, self.p50_cv
            )
        ]


def spread(seconds: Sequence[float], blocks: int = BLOCKS) -> float:
    """The coefficient of variation of p50 across `blocks` consecutive stretches of the calls:
    repeated measurements, in the order they were taken, so load that came and went shows."""
    if len(seconds) < 2 * blocks:
        return 0.0
    medians = [float(np.median(part)) for part in np.array_split(np.asarray(seconds, dtype=float), blocks)]
    mean = float(np.mean(medians))
    return float(np.std(medians) / mean) if mean > 0 else 0.0


def measure(
    model: nn.Module,
    n_features: int | Sequence[int],
    batch_sizes: Sequence[int] = BATCH_SIZES,
    *,
    repeats: int | None = None,
    budget_s: float = 1.0,
    floor_cap_s: float = FLOOR_CAP_S,
) -> LatencyReport:
    """Latency of `model` on synthetic float32 input (b, n_features) for each batch size b.

    `repeats` fixes the timed calls per batch size. None repeats until this batch size's share
    of `budget_s` (the whole measurement, warm-up aside) is spent, never fewer than MIN_REPEATS
    nor more than MAX_REPEATS calls. A model too slow for MIN_REPEATS calls in the budget still
    gets them, up to `floor_cap_s` a batch size: the budget buys precision beyond a meaningful
    p99, it does not cut below one. Only a model slower than that stops short, after at least
    FEWEST_REPEATS calls (`LatencyReport.repeats` says how many).
    """
    return measure_side_by_side(
        {"model": model}, n_features, batch_sizes, repeats=repeats, budget_s=budget_s, floor_cap_s=floor_cap_s
    )["model"]


def measure_side_by_side(
    models: dict[str, nn.Module],
    n_features: int | Sequence[int],
    batch_sizes: Sequence[int] = BATCH_SIZES,
    *,
    repeats: int | None = None,
    budget_s: float = 1.0,
    make_input: Callable[[int, torch.Generator], torch.Tensor] | None = None,
    floor_cap_s: float = FLOOR_CAP_S,
) -> dict[str, LatencyReport]:
    """`measure` for several models at once, one report per name.

    `make_input(b, generator)`, if given, makes the batch of b examples instead of float32 noise
    of shape (b, *n_features): token ids for a language model, say.

    Each repetition times every model once, in an order that rotates, so machine drift (other
    load, frequency scaling) and position in the loop hit all of them alike: their ratios are
    then worth more than any one absolute number.
    """
    if not models:
        raise ValueError("models must name at least one model")
    shape = (n_features,) if isinstance(n_features, int) else tuple(int(d) for d in n_features)
    if not shape or min(shape) <= 0:
        raise ValueError(f"n_features (or the per-example input shape) must be > 0, got {n_features}")
    if not batch_sizes or any(int(b) <= 0 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive sizes, got {list(batch_sizes)}")
    if repeats is not None and repeats <= 0:
        raise ValueError(f"repeats must be > 0 (or None to fit the budget), got {repeats}")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")

    names = list(models)
    devices = {name: _device(m) for name, m in models.items()}  # an int8 copy may be on CPU beside a GPU model
    reports = {
        name: LatencyReport(
            model=name, n_features=math.prod(shape), device=str(devices[name]), threads=torch.get_num_threads()
        )
        for name in names
    }
    modes = {name: m.training for name, m in models.items()}
    gc_was_enabled = gc.isenabled()
    generator = torch.Generator().manual_seed(0)
    try:
        for m in models.values():
            m.eval()
        gc.disable()  # a collection inside a timed call is the harness's noise, not the model's
        with torch.inference_mode():
            for b in (int(b) for b in batch_sizes):
                if make_input is not None:
                    x = make_input(b, generator)
                else:
                    x = torch.randn(b, *shape, generator=generator, dtype=torch.float32)
                calls = {name: _timed_call(m, x.to(devices[name]), devices[name]) for name, m in models.items()}
                for call in calls.values():
                    _warm_up(call)
                times = _interleaved(calls, names, repeats, budget_s / len(batch_sizes), floor_cap_s)
                for name in names:
                    reports[name].add(b, times[name])
    finally:
        for name, m in models.items():
            m.train(modes[name])
        if gc_was_enabled:
            gc.enable()
    return reports


def _device(model: nn.Module) -> torch.device:
    """Where the model's parameters live (CPU for a model without any, or packed int8 ones)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _timed_call(model: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[], float]:
    """A call of `model` on `x` that returns its wall time in seconds, the device's work included."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def call() -> float:
        start = time.perf_counter()
        model(x)
        sync()  # CUDA runs asynchronously: without it we would time the launch only
        return time.perf_counter() - start

    sync()
    return call


def _warm_up(call: Callable[[], float]) -> None:
    """Call until WARMUP_S has passed, and at least WARMUP_CALLS times, however slow."""
    deadline = time.perf_counter() + WARMUP_S
    calls = 0
    while calls < WARMUP_CALLS or time.perf_counter() < deadline:
        call()
        calls += 1


def _interleaved(
    calls: dict[str, Callable[[], float]],
    names: list[str],
    repeats: int | None,
    budget_s: float,
    floor_cap_s: float = FLOOR_CAP_S,
) -> dict[str, list[float]]:
    """Rounds that time every model once each, the order rotated by one each round: `repeats`
    rounds, or (None) rounds until `budget_s` is spent, within [MIN_REPEATS, MAX_REPEATS], and
    short of MIN_REPEATS (but not of FEWEST_REPEATS) once `floor_cap_s` is spent."""
    times: dict[str, list[float]] = {name: [] for name in names}
    # A deadline rather than a count estimated from the warm-up: on a loaded machine a few slow
    # warm-up calls would mislead the estimate, and the budget would not hold.
    started = time.perf_counter()
    deadline, floor_deadline = started + budget_s, started + floor_cap_s

    def more(r: int) -> bool:
        if repeats is not None:
            return r < repeats
        now = time.perf_counter()
        if r < MIN_REPEATS:
            return r < FEWEST_REPEATS or now < floor_deadline
        return r < MAX_REPEATS and now < deadline

    r = 0
    while more(r):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(calls[name]())
        r += 1
    return times
