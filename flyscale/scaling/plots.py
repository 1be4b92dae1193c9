"""A scaling study's figures: the validation metric (a classifier's error, anyone else's loss)
against training rows (or tokens) and parameters (log-log,
with the fit, its doubling and the knee), the train/validation gap per point, and throughput,
speed-up and parallel efficiency against workers."""

from __future__ import annotations

import os
import textwrap

import numpy as np

from flyscale.render.plots import figure
from flyscale.scaling.advice import StudyResult
from flyscale.scaling.config import ScalingConfig
from flyscale.scaling.plan import ScalingPoint, on_axis, size_of

FLOOR = 1e-4  # a zero error on log axes: drawn here, at the bottom


def _nothing(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _error_curve(ax, result: StudyResult, axis: str) -> None:
    """The val metric against training rows (tokens) or parameters, log-log, with the measured
    noise, the fit, its doubling and the knee."""
    fit, knee = (result.data_fit, result.data_knee) if axis == "data" else (result.model_fit, result.model_knee)
    noun = result.data_noun if axis == "data" else "parameters"
    metric = result.metric
    ax.set_title(f"validation {metric} vs {noun}", fontsize=10)
    points = on_axis(result.points, axis)
    if len(points) < 2:
        return _nothing(ax, f"the {axis} axis was not swept")
    x = np.array([size_of(p, axis) for p in points])
    ax.set_xscale("log")
    ax.set_yscale("log")
    y = np.maximum([p.val_metric for p in points], FLOOR)
    spread = np.array([2 * p.val_noise for p in points])
    ax.errorbar(
        x,
        y,
        yerr=[np.minimum(spread, y - FLOOR), spread],  # a log axis has nothing below the floor
        fmt="o",
        color="C0",
        capsize=2,
        label="measured (2 standard errors)",
    )
    if fit.meaningful:
        inside, beyond = np.geomspace(x.min(), fit.largest, 100), np.geomspace(fit.largest, 2 * fit.largest, 20)
        ax.plot(
            inside,
            fit.predict(inside),
            "-",
            color="C1",
            label=f"fit: beta {fit.beta:.2f}, gamma {fit.gamma:.4f}, R^2 {fit.r2_log:.2f}",
        )
        ax.plot(beyond, fit.predict(beyond), "--", color="C1")
        doubled = float(fit.predict(fit.largest)) - fit.drop
        ax.errorbar(
            [2 * fit.largest],
            [doubled],
            yerr=[[fit.drop_high - fit.drop], [fit.drop - fit.drop_low]],
            fmt="s",
            color="C1",
            capsize=3,
            label=f"doubled: -{fit.drop:.4f} (90%: {fit.drop_low:.4f}-{fit.drop_high:.4f})",
        )
        if fit.gamma > 0.1 * y.min():  # a gamma near zero would stretch the axis over decades of nothing
            ax.axhline(fit.gamma, ls=":", color="grey", label=f"gamma: irreducible {metric}")
    else:
        ax.text(0.03, 0.03, textwrap.fill(f"no fit: {fit.reason}", 55), transform=ax.transAxes, fontsize=7)
    if knee.found:
        ax.axvline(knee.size, ls="--", lw=1, color="C2", label=f"knee: {knee.size:,.0f}")
    ax.set_xlabel(noun)
    ax.set_ylabel(f"validation {metric}")
    ax.legend(fontsize=7, loc="best")


def _workers(axes, result: StudyResult) -> None:
    """Throughput, speed-up and parallel efficiency against workers, as measured."""
    advice = result.workers
    titles = ("throughput", "speed-up", "parallel efficiency")
    for ax, title in zip(axes, titles):
        ax.set_title(f"{title} vs workers", fontsize=10)
    if not advice.measured:
        for ax in axes:
            _nothing(ax, "fewer than 2 worker counts")
        return
    n = [r.workers for r in advice.table]
    axes[0].plot(n, [r.samples_per_s for r in advice.table], "o-")
    axes[0].set_ylabel("training samples/s")
    axes[1].plot(n, [r.speedup for r in advice.table], "o-", label="measured")
    axes[1].plot(n, [w / n[0] for w in n], ":", color="grey", label="linear")
    spread = [[r.efficiency - r.low for r in advice.table], [r.high - r.efficiency for r in advice.table]]
    axes[2].errorbar(
        n, [r.efficiency for r in advice.table], yerr=spread, fmt="o-", capsize=3, label="measured (epochs' quartiles)"
    )
    axes[2].axhline(advice.threshold, ls="--", color="C3", label=f"min_efficiency {advice.threshold:g}")
    axes[2].set_ylim(0, max(1.1, *(r.high + 0.1 for r in advice.table)))
    for ax in axes:
        ax.set_xticks(n)
        ax.set_xlabel("workers")
        ax.axvline(advice.workers, lw=6, alpha=0.15, color="C2")  # the recommended count
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)


def _label(p: ScalingPoint) -> str:
    return f"data {p.data_fraction:g}, width {p.width_multiplier:g}, depth {p.depth_multiplier:g}, {p.workers}w"


def _gap(ax, result: StudyResult, max_gap: float) -> None:
    """Val minus train metric per point: over-fitting."""
    points = sorted(result.points, key=lambda p: p.key)
    rows = np.arange(len(points))
    ax.barh(rows, [p.gap for p in points], color=["C3" if p.gap > max_gap else "C0" for p in points])
    ax.axvline(max_gap, ls="--", color="C3", label=f"max_gap {max_gap:g}")
    ax.set_yticks(rows, [_label(p) for p in points], fontsize=7)
    metric = result.metric
    ax.set_xlabel("train accuracy - val accuracy" if metric == "error" else f"val {metric} - train {metric}")
    ax.set_title("train/validation gap per point", fontsize=10)
    ax.legend(fontsize=7)


def plot_study(result: StudyResult, cfg: ScalingConfig, folder: str) -> dict[str, str]:
    """{file name: path} of the study's plots: one overview and each view on its own."""
    out = {}
    overview = figure(figsize=(15, 8.5))
    grid = overview.subplots(2, 3)
    _error_curve(grid[0][0], result, "data")
    _error_curve(grid[0][1], result, "model")
    _gap(grid[0][2], result, cfg.max_gap)
    _workers(grid[1], result)
    parts = {"scaling.png": overview}
    for name, axis in ((f"{result.metric}_vs_data.png", "data"), (f"{result.metric}_vs_parameters.png", "model")):
        parts[name] = figure(figsize=(6, 4.5))
        _error_curve(parts[name].subplots(), result, axis)
    parts["workers.png"] = figure(figsize=(13, 4))
    _workers(parts["workers.png"].subplots(1, 3), result)
    parts["gap.png"] = figure(figsize=(7, 1.5 + 0.35 * len(result.points)))
    _gap(parts["gap.png"].subplots(), result, cfg.max_gap)
    for name, fig in parts.items():
        fig.tight_layout()
        out[name] = os.path.join(folder, name)
        fig.savefig(out[name], dpi=80)
    return out
