"""Test-set metrics and model size: the numbers gates and MLflow read."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch import nn


@dataclass
class EvalMetrics:
    """How a model did on the test split."""

    accuracy: float
    macro_f1: float
    loss: float
    n: int
    confusion: list[list[int]]  # rows: true class, columns: predicted class
    size_bytes: int  # serialized state_dict
    weights_sha256: str = ""  # the evaluated weights file: what a champion is recognised by

    def scalars(self, prefix: str = "") -> dict[str, float]:
        return {
            f"{prefix}accuracy": self.accuracy,
            f"{prefix}macro_f1": self.macro_f1,
            f"{prefix}loss": self.loss,
            f"{prefix}size_bytes": float(self.size_bytes),
        }


def state_dict_bytes(model: nn.Module) -> int:
    """Size of the model as it is stored (packed int8 weights count as int8)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> EvalMetrics:
    """Accuracy, macro-F1, mean loss and confusion matrix of `model` on (x, y)."""
    return evaluate_batches(model, ((x[i : i + 1024], y[i : i + 1024]) for i in range(0, len(y), 1024)), num_classes)


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], num_classes: int) -> EvalMetrics:
    """The same metrics over batches as they come: memory holds a batch and the predictions."""
    # Imported here: scikit-learn costs a second at import, and every task module imports this one.
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    model.eval()
    loss_sum, preds, truths = 0.0, [], []
    for xb, yb in batches:
        logits = model(xb)
        loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        preds.append(logits.argmax(1).numpy())
        truths.append(yb.numpy())
    pred, truth = np.concatenate(preds), np.concatenate(truths)
    return EvalMetrics(
        accuracy=float(accuracy_score(truth, pred)),
        macro_f1=float(f1_score(truth, pred, average="macro", labels=list(range(num_classes)), zero_division=0)),
        loss=loss_sum / max(len(truth), 1),
        n=len(truth),
        confusion=confusion_matrix(truth, pred, labels=list(range(num_classes))).tolist(),
        size_bytes=state_dict_bytes(model),
    )


def plot_confusion(confusion: list[list[int]], title: str, path: str) -> str:
    """Write the confusion matrix as a PNG for the MLflow run; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")  # tasks run headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    im = ax.imshow(confusion, cmap="Blues")
    n = len(confusion)
    for i in range(n):
        for j in range(n):
            value = confusion[i][j]
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color="white" if value > 0.5 * max(map(max, confusion)) else "black")
    ax.set(xlabel="predicted", ylabel="true", title=title, xticks=range(n), yticks=range(n))
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
