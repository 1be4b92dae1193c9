"""HTML for Flyte Decks: what a person opens in the Flyte UI to see how a run trained.

A Deck is one self-contained HTML page, so the plot travels inline as a base64 PNG: no file
behind Flyte's back, nothing to fetch when the page is opened.
"""

from __future__ import annotations

import base64
import html
import io
import os

from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.render import plots
from flyscale.train.telemetry import TrainHistory


def _curves_png(history: TrainHistory) -> bytes:
    """Loss and accuracy per epoch, train against validation, as PNG bytes."""
    # The object API, not pyplot: no global figure state, no GUI backend to pick in a worker.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    epochs = [m.epoch + 1 for m in history.epochs]
    fig = Figure(figsize=(9, 3.4))
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(epochs, [m.train_loss for m in history.epochs], marker=".", label="train")
    loss_ax.plot(epochs, [m.val_loss for m in history.epochs], marker=".", label="validation")
    loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
    if all(m.train_accuracy is not None for m in history.epochs):  # measured only when asked for
        acc_ax.plot(epochs, [m.train_accuracy for m in history.epochs], marker=".", label="train")
    acc_ax.plot(epochs, [m.val_accuracy for m in history.epochs], marker=".", label="validation")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _epoch_table(history: TrainHistory) -> str:
    """Per-epoch numbers: the learning curves' values plus where the time went."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("epoch", "train loss", "val loss", "train acc", "val acc", "samples/s", "data wait", "seconds")
    )
    rows = [
        f"<tr><td>{m.epoch + 1}</td><td>{m.train_loss:.4f}</td><td>{m.val_loss:.4f}</td>"
        f"<td>{'-' if m.train_accuracy is None else f'{m.train_accuracy:.4f}'}</td><td>{m.val_accuracy:.4f}</td>"
        f"<td>{m.samples_per_s:.0f}</td>"
        f"<td>{m.data_wait_fraction:.0%}</td><td>{m.seconds:.2f}</td></tr>"
        for m in history.epochs
    ]
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def learning_curves_html(history: TrainHistory) -> str:
    """The "Learning curves" Deck: the plot, then the per-epoch table."""
    if not history.epochs:
        return "<p>No epochs were trained.</p>"
    png = base64.b64encode(_curves_png(history)).decode("ascii")
    last = history.epochs[-1]
    summary = (
        f"{html.escape(history.strategy)} on {history.world_size} worker(s), {len(history.epochs)} epochs; "
        f"last epoch: val loss {last.val_loss:.4f}, val accuracy {last.val_accuracy:.4f}, "
        f"{last.samples_per_s:.0f} samples/s"
    )
    diagnosis = f"<p><b>Diagnosis:</b> {html.escape(history.diagnosis)}</p>" if history.diagnosis else ""
    return (
        f"<h3>Learning curves</h3><p>{summary}</p>{diagnosis}"
        f'<img alt="learning curves" src="data:image/png;base64,{png}"/>'
        f"{_epoch_table(history)}"
    )


def _png(path: str) -> str:
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode("ascii")


# The Deck's figures, {alt text: file in the run's plots folder}, in the order shown.
DECK_PLOTS = {
    "fp32 confusion": plots.CONFUSION_FP32,
    "int8 confusion": plots.CONFUSION_INT8,
    "reliability": plots.RELIABILITY,
    "residuals": plots.RESIDUALS,
    "latency": plots.LATENCY,
}


def evaluation_html(fp32: EvalMetrics, int8: EvalMetrics, comparison: Comparison, plots_dir: str) -> str:
    """The "Evaluation" Deck: test metrics of both models, latency side by side, the confusion
    matrices, the reliability diagram and latency against batch size: the PNGs `plots.draw_run`
    wrote to `plots_dir`, the very files the MLflow run gets."""
    figures = "".join(
        f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{_png(f"{plots_dir}/{name}")}"/>'
        for alt, name in DECK_PLOTS.items()
        if os.path.exists(f"{plots_dir}/{name}")  # what fits the objective was drawn
    )
    if not fp32.classifier:
        return _objective_html(fp32, int8, comparison, figures)
    rows = "".join(
        f"<tr><td>{label}</td><td>{m.accuracy:.4f}</td><td>{m.macro_f1:.4f}</td><td>{m.loss:.4f}</td>"
        f"<td>{m.ece:.4f}</td><td>{m.size_bytes / 1024:.1f}</td></tr>"
        for label, m in (("fp32", fp32), (html.escape(comparison.quantizer), int8))
    )
    latency = "".join(f"<li>{html.escape(line)}</li>" for line in comparison.lines())
    return (
        "<h3>Evaluation on the test split</h3><table><thead><tr><th>model</th><th>accuracy</th><th>macro-F1</th>"
        f"<th>loss</th><th>ECE</th><th>KiB</th></tr></thead><tbody>{rows}</tbody></table>"
        f"<h4>Latency, measured side by side</h4><ul>{latency}</ul>{figures}"
    )


def _objective_html(fp32: EvalMetrics, int8: EvalMetrics, comparison: Comparison, figures: str) -> str:
    """The "Evaluation" Deck of an objective other than classification: its own metrics for both
    models, what int8 costs, latency, the figures, and a language model's generated samples."""
    names = list(fp32.values)
    head = "".join(f"<th>{html.escape(n.replace('_', ' '))}</th>" for n in names)
    rows = "".join(
        f"<tr><td>{label}</td><td>{m.loss:.4f}</td>"
        + "".join(f"<td>{m.values.get(n, float('nan')):.4f}</td>" for n in names)
        + f"<td>{m.size_bytes / 1024:.1f}</td></tr>"
        for label, m in (("fp32", fp32), (html.escape(comparison.quantizer), int8))
    )
    costs = "".join(f"<li>{html.escape(k.replace('_', ' '))}: {v:+.4f}</li>" for k, v in comparison.costs.items())
    samples = "".join(
        f"<p><b>{html.escape(label)}</b>, from <code>{html.escape(repr(p))}</code>:</p><pre>{html.escape(p + c)}</pre>"
        for label, m in (("fp32", fp32), ("int8", int8))
        for p, c in m.samples.items()
    )
    latency = "".join(f"<li>{html.escape(line)}</li>" for line in comparison.lines())
    return (
        f"<h3>Evaluation on the test split ({html.escape(fp32.objective)})</h3>"
        f"<table><thead><tr><th>model</th><th>loss</th>{head}<th>KiB</th></tr></thead><tbody>{rows}</tbody></table>"
        + (f"<h4>What int8 costs</h4><ul>{costs}</ul>" if costs else "")
        + (f"<h4>Generated (sampled, seed 0)</h4>{samples}" if samples else "")
        + f"<h4>Latency, measured side by side</h4><ul>{latency}</ul>{figures}"
    )
