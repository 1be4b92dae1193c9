"""How many workers pay, from a study's measured throughput alone: the speed-up and parallel
efficiency of each worker count against the fewest measured, with the range its epochs' spread
allows, and the largest count that keeps `scaling.min_efficiency` of linear scaling."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flyscale.scaling.plan import ScalingPoint, on_axis


@dataclass
class Efficiency:
    workers: int
    samples_per_s: float
    speedup: float  # throughput against the fewest workers measured
    efficiency: float  # speed-up per added worker: speedup * fewest / workers
    low: float = 0.0  # the efficiency the epochs' throughput quartiles allow, at worst and at best
    high: float = 0.0


@dataclass
class WorkerAdvice:
    """The worker count beyond which parallel efficiency falls under the threshold."""

    measured: bool
    workers: int
    sentence: str
    threshold: float = 0.0
    table: list[Efficiency] = field(default_factory=list)


def worker_advice(points: list[ScalingPoint], min_efficiency: float) -> WorkerAdvice:
    """From measured throughput only: the largest count up to which every count keeps at least
    `min_efficiency` of linear scaling, against the fewest workers measured. Each efficiency comes
    with the range its epochs' throughput quartiles allow; a range across the threshold is said."""
    by_count: dict[int, list[ScalingPoint]] = {}
    for p in on_axis(points, "workers"):
        by_count.setdefault(p.workers, []).append(p)
    if len(by_count) < 2:
        return WorkerAdvice(False, 0, "workers: not swept (fewer than 2 worker counts)")
    counts = sorted(by_count)
    speed = {n: float(np.median([p.samples_per_s for p in by_count[n]])) for n in counts}
    # Unknown quartiles (0) are the median itself: no spread claimed that was not measured.
    low = {n: min(p.samples_per_s_low or p.samples_per_s for p in by_count[n]) for n in counts}
    high = {n: max(p.samples_per_s_high or p.samples_per_s for p in by_count[n]) for n in counts}
    n0 = counts[0]
    if speed[n0] <= 0 or low[n0] <= 0:
        return WorkerAdvice(False, 0, f"workers: no throughput was measured at {n0} worker(s)")
    table = [
        Efficiency(
            n,
            speed[n],
            speed[n] / speed[n0],
            speed[n] / speed[n0] * n0 / n,
            low[n] / high[n0] * n0 / n,
            high[n] / low[n0] * n0 / n,
        )
        for n in counts
    ]
    chosen = n0
    for row in table[1:]:
        if row.efficiency < min_efficiency:
            break
        chosen = row.workers
    shown = "; ".join(
        f"{r.workers}: {r.samples_per_s:,.0f} samples/s, {r.speedup:.2f}x, efficiency "
        f"{r.efficiency:.2f} ({r.low:.2f}-{r.high:.2f})"
        for r in table
    )
    after = next((r for r in table if r.workers > chosen), None)
    why = (
        f"{after.workers} workers reach efficiency {after.efficiency:.2f}, under scaling.min_efficiency "
        f"{min_efficiency:.2f}"
        if after
        else f"every count measured keeps efficiency >= {min_efficiency:.2f}"
    )
    unsure = [r.workers for r in table[1:] if r.low < min_efficiency <= r.high]
    doubt = (
        f"; the epochs' spread puts {', '.join(map(str, unsure))} worker(s) on both sides of the threshold: "
        f"measure again with more epochs, or on a machine nothing else is using"
        if unsure
        else ""
    )
    name = "one worker" if chosen == 1 else f"{chosen} workers"
    said = f"workers: use {name}: {why} (measured {shown}){doubt}{_bound_by_communication(by_count, chosen)}"
    return WorkerAdvice(True, chosen, said, min_efficiency, table)


def _bound_by_communication(by_count: dict[int, list[ScalingPoint]], chosen: int) -> str:
    """What the advice makes of the trainings that said they were communication-bound, which rest
    on the same epochs as the throughput: where it recommends their count, the measured speed-up
    already pays for the collectives; where it does not, they are why."""
    flagged = sorted(n for n, ps in by_count.items() if n > 1 and any("communication-bound" in p.diagnosis for p in ps))
    kept = [n for n in flagged if n <= chosen]
    dropped = [n for n in flagged if n > chosen]
    out = ""
    if kept:
        out += (
            f"; the training on {', '.join(map(str, kept))} worker(s) found its collectives in flight much of "
            f"each step (communication-bound), but they overlap the computation: the speed-up measured over "
            f"the same epochs is what that costs, and it still pays"
        )
    if dropped:
        out += (
            f"; the training on {', '.join(map(str, dropped))} worker(s) was communication-bound, which is "
            f"where the efficiency goes"
        )
    return out
