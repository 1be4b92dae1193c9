"""The run's figures: confusion matrices, reliability diagram, learning curves, latency against batch size,
and a regressor's residuals.

Each function writes a PNG and returns the Figure (for a caller that inspects it). `draw_run`
draws every figure that fits the run's objective once, into one folder (`run_plots` names them): the quantize task shows them in its Deck and
hands the folder on, and the register task logs those very files to MLflow (rendering a figure
costs a good part of a second; drawing each twice cost every run seconds).

The figures are made without pyplot: pyplot keeps every figure it makes alive until it is
closed, so a long-lived process plotting every run would grow; a bare Figure on an Agg canvas
holds no global state and is freed with its last reference. Headless: Agg needs no display.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: importing training pulls in the data stack
    from matplotlib.figure import Figure

    from flyscale.evaluate.comparison import Comparison
    from flyscale.evaluate.latency import LatencyReport
    from flyscale.evaluate.metrics import EvalMetrics
    from flyscale.train.telemetry import TrainHistory

DPI = 110

# The run's figures by file name: their names under the MLflow run's plots/ too.
CONFUSION_FP32, CONFUSION_INT8 = "confusion_fp32.png", "confusion_int8.png"
RELIABILITY, LEARNING_CURVES, LATENCY = "reliability_fp32.png", "learning_curves.png", "latency.png"
RUN_PLOTS = (CONFUSION_FP32, CONFUSION_INT8, RELIABILITY, LEARNING_CURVES, LATENCY)  # a classifier's
RESIDUALS = "residuals_fp32.png"


def run_plots(objective: str) -> tuple[str, ...]:
    """The figures `draw_run` draws for a run of `objective`, by file name: a classifier's
    (RUN_PLOTS), a regressor's residuals, and for every objective the learning curves and latency."""
    if objective == "classification":
        return RUN_PLOTS
    own = (RESIDUALS,) if objective == "regression" else ()
    return (*own, LEARNING_CURVES, LATENCY)


def figure(**kwargs) -> Figure:
    """A bare Figure on an Agg canvas: no pyplot, so nothing global keeps it alive."""
    # Imported here: matplotlib costs a noticeable part of a second, and only plotting needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str) -> Figure:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return fig


def _nothing_to_plot(fig: Figure, path: str, what: str) -> Figure:
    """An honest empty figure: better than none where a Deck or a run expects one."""
    fig.text(0.5, 0.5, what, ha="center", va="center")
    return _save(fig, path)


def draw_run(folder: str, fp32: EvalMetrics, int8: EvalMetrics, comparison: Comparison, history: TrainHistory) -> str:
    """Every figure of a run that fits its objective (`run_plots(fp32.objective)`), each drawn
    once, as PNGs in `folder`; returns `folder`. A confusion matrix or a reliability diagram
    means nothing without classes: only a classifier's run has them, and a regressor's has its
    residuals instead."""
    if fp32.classifier:
        confusion_matrix(fp32.confusion, "fp32 test confusion", f"{folder}/{CONFUSION_FP32}")
        confusion_matrix(int8.confusion, "int8 test confusion", f"{folder}/{CONFUSION_INT8}")
        reliability_diagram(fp32, "fp32 reliability", f"{folder}/{RELIABILITY}")
    elif fp32.objective == "regression":
        residual_plot(fp32, "fp32 test residuals", f"{folder}/{RESIDUALS}")
    # Validation counts hits for a classifier (and a language model's next token); an objective
    # without classes has none, and a panel of zeros would read as a model that never learned.
    hits = fp32.classifier or any(m.val_accuracy > 0 for m in history.epochs)
    learning_curves(history, f"{folder}/{LEARNING_CURVES}", accuracy=hits)
    latency_plot(
        {"fp32": comparison.fp32_latency, f"int8 ({comparison.quantizer})": comparison.int8_latency},
        f"{folder}/{LATENCY}",
    )
    return folder


def confusion_matrix(confusion: list[list[int]], title: str, path: str) -> Figure:
    """Counts per (true, predicted) class, each cell labelled, with a colour bar."""
    fig = figure(figsize=(5, 4.5))
    ax = fig.subplots()
    im = ax.imshow(confusion, cmap="Blues")
    n = len(confusion)
    dark = 0.5 * max(map(max, confusion))  # white text above this, where the cell is dark
    for i in range(n):
        for j in range(n):
            value = confusion[i][j]
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color="white" if value > dark else "black")
    ax.set(xlabel="predicted", ylabel="true", title=title, xticks=range(n), yticks=range(n))
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)


def reliability_diagram(metrics: EvalMetrics, title: str, path: str) -> Figure:
    """Accuracy against confidence per calibration bin, the diagonal, and how many fell in each bin."""
    fig = figure(figsize=(5, 5.5))
    bins = len(metrics.reliability_count)
    if not bins:
        return _nothing_to_plot(fig, path, f"{title}\nno calibration data (metrics from before calibration)")
    ax, hist = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    width = 1.0 / bins
    lefts = [k * width for k in range(bins)]
    filled = [c > 0 for c in metrics.reliability_count]
    acc = [a if f else 0.0 for a, f in zip(metrics.reliability_accuracy, filled)]
    conf = [c if f else 0.0 for c, f in zip(metrics.reliability_confidence, filled)]
    ax.bar(lefts, acc, width=width, align="edge", color="tab:blue", edgecolor="black", linewidth=0.5, label="accuracy")
    # The gap from each bin's accuracy to its mean confidence: what the ECE weighs and sums.
    ax.bar(
        lefts,
        [c - a for c, a in zip(conf, acc)],
        bottom=acc,
        width=width,
        align="edge",
        color="tab:red",
        alpha=0.3,
        edgecolor="tab:red",
        linewidth=0.5,
        label="gap to confidence",
    )
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfectly calibrated")
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy", title=f"{title}  (ECE {metrics.ece:.4f})")
    ax.legend(loc="upper left", fontsize=8)
    hist.bar(
        lefts, metrics.reliability_count, width=width, align="edge", color="grey", edgecolor="black", linewidth=0.5
    )
    hist.set(xlabel="confidence (top-class softmax)", ylabel="count")
    return _save(fig, path)


def learning_curves(history: TrainHistory, path: str, accuracy: bool = True) -> Figure:
    """Training and validation loss, and validation accuracy (training accuracy where tracked), per
    epoch; the loss alone without `accuracy` (an objective that counts no hits)."""
    fig = figure(figsize=(9 if accuracy else 5, 3.8))
    if not history.epochs:
        return _nothing_to_plot(fig, path, "no epochs recorded")
    loss_ax, acc_ax = fig.subplots(1, 2) if accuracy else (fig.subplots(), None)
    epochs = [m.epoch + 1 for m in history.epochs]
    loss_ax.plot(epochs, [m.train_loss for m in history.epochs], "o-", label="train loss")
    loss_ax.plot(epochs, [m.val_loss for m in history.epochs], "s-", label="val loss")
    loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
    if acc_ax is None:
        _curve_style(loss_ax)
        fig.suptitle(f"{history.strategy}, world size {history.world_size}", fontsize=10)
        return _save(fig, path)
    acc_ax.plot(epochs, [m.val_accuracy for m in history.epochs], "s-", color="tab:orange", label="val accuracy")
    tracked = [(e, m.train_accuracy) for e, m in zip(epochs, history.epochs) if m.train_accuracy is not None]
    if tracked:  # None: not measured, so not drawn as zero
        acc_ax.plot(*zip(*tracked), "o-", color="tab:blue", label="train accuracy")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (loss_ax, acc_ax):
        _curve_style(ax)
    fig.suptitle(f"{history.strategy}, world size {history.world_size}", fontsize=10)
    return _save(fig, path)


def _curve_style(ax) -> None:
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def residual_plot(metrics: EvalMetrics, title: str, path: str) -> Figure:
    """A regressor's first target: predicted against actual (on the diagonal when right), and the
    residual (actual - predicted) against the prediction (a trend or a funnel there is error the
    model could still explain). From the sample of pairs the evaluation kept (at most PLOTTED)."""
    fig = figure(figsize=(10, 4.2))
    if not metrics.predicted:
        return _nothing_to_plot(fig, path, f"{title}\nno predictions kept")
    fit_ax, res_ax = fig.subplots(1, 2)
    predicted, actual = metrics.predicted, metrics.actual
    residual = [a - p for p, a in zip(predicted, actual)]
    low, high = min(min(predicted), min(actual)), max(max(predicted), max(actual))
    fit_ax.scatter(actual, predicted, s=10, alpha=0.6, color="tab:blue", edgecolors="none")
    fit_ax.plot([low, high], [low, high], "k--", linewidth=1, label="predicted = actual")
    r2 = metrics.values.get("r2")
    fit_ax.set(
        xlabel="actual",
        ylabel="predicted",
        title="predicted against actual" + (f"  (R² {r2:.3f})" if r2 is not None else ""),
    )
    fit_ax.legend(loc="upper left", fontsize=8)
    res_ax.scatter(predicted, residual, s=10, alpha=0.6, color="tab:orange", edgecolors="none")
    res_ax.axhline(0.0, color="black", linestyle="--", linewidth=1)
    res_ax.set(xlabel="predicted", ylabel="residual (actual - predicted)", title="residuals")
    for ax in (fit_ax, res_ax):
        ax.grid(alpha=0.3)
    shown = f"{len(predicted)} of {metrics.n}" if len(predicted) < metrics.n else f"all {metrics.n}"
    fig.suptitle(f"{title}: {shown} test examples", fontsize=10)
    return _save(fig, path)


def latency_plot(reports: dict[str, LatencyReport], path: str) -> Figure:
    """Latency p50 (points) with a whisker up to p99 against batch size, log axes, one line per model."""
    fig = figure(figsize=(6, 4.2))
    if not any(r.batch_sizes for r in reports.values()):
        return _nothing_to_plot(fig, path, "no latency measured")
    ax = fig.subplots()
    for name, r in reports.items():
        up = [max(p99 - p50, 0.0) for p50, p99 in zip(r.p50_ms, r.p99_ms)]
        ax.errorbar(r.batch_sizes, r.p50_ms, yerr=[[0.0] * len(up), up], marker="o", capsize=3, label=name or r.model)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch size",
        ylabel="latency per batch (ms)",
        title="inference latency: p50, whisker to p99",
    )
    ax.set_xticks(sorted({b for r in reports.values() for b in r.batch_sizes}))
    ax.get_xaxis().set_major_formatter("{x:.0f}")
    ax.tick_params(axis="x", which="minor", labelbottom=False)  # the batch sizes label the axis, nothing between
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)
