"""Test-set metrics and model size: the numbers gates and MLflow read."""

from __future__ import annotations

import fnmatch
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

CALIBRATION_BINS = 15  # equal-width confidence bins of the expected calibration error (Guo et al. 2017)


@dataclass
class EvalMetrics:
    """How a model did on the test split.

    Fields after `weights_sha256` came later: they have defaults so that metrics cached by an
    older flyscale still load. There, the lists are empty and `scalars` leaves their keys out
    rather than report a calibration error of 0 that was never measured.
    """

    accuracy: float
    macro_f1: float
    loss: float
    n: int
    confusion: list[list[int]]  # rows: true class, columns: predicted class
    size_bytes: int  # serialized state_dict
    weights_sha256: str = ""  # the evaluated weights file: what a champion is recognised by
    precision: list[float] = field(default_factory=list)  # per class, indexed by class (0 where never predicted)
    recall: list[float] = field(default_factory=list)  # per class, indexed by class (0 where absent)
    ece: float = 0.0  # expected calibration error of the top-class softmax confidence
    # The reliability diagram, one entry per equal-width confidence bin, (k/B, (k+1)/B]:
    reliability_confidence: list[float] = field(default_factory=list)  # mean confidence (0 in an empty bin)
    reliability_accuracy: list[float] = field(default_factory=list)  # share correct (0 in an empty bin)
    reliability_count: list[int] = field(default_factory=list)  # predictions in the bin
    # Which objective measured these. A classifier fills the fields above; every other objective
    # reports its own metrics in `values` (its `metrics` say which way each is better), and
    # leaves the classifier's fields at 0.
    objective: str = "classification"
    values: dict[str, float] = field(default_factory=dict)
    samples: dict[str, str] = field(default_factory=dict)  # {prompt: continuation}: a language model's
    # A regressor's first target: up to PLOTTED predictions and their true values, for the residual plot.
    predicted: list[float] = field(default_factory=list)
    actual: list[float] = field(default_factory=list)

    @property
    def classifier(self) -> bool:
        return self.objective == "classification"

    def scalars(self, prefix: str = "") -> dict[str, float]:
        """The metrics MLflow and the gates read, by stable names (`prefix` + name)."""
        if not self.classifier:
            return {
                f"{prefix}loss": self.loss,
                f"{prefix}size_bytes": float(self.size_bytes),
                **{f"{prefix}{k}": float(v) for k, v in self.values.items()},
            }
        out = {
            f"{prefix}accuracy": self.accuracy,
            f"{prefix}macro_f1": self.macro_f1,
            f"{prefix}loss": self.loss,
            f"{prefix}size_bytes": float(self.size_bytes),
        }
        if self.reliability_count:  # measured (metrics from before calibration have no bins)
            out[f"{prefix}ece"] = self.ece
        out.update({f"{prefix}precision_class_{k}": float(v) for k, v in enumerate(self.precision)})
        out.update({f"{prefix}recall_class_{k}": float(v) for k, v in enumerate(self.recall)})
        return out


# Which way is better, for each family of metric flyscale records. Checked in this order, the
# first match wins: `*_drop` first, so that "accuracy_drop" is a loss of accuracy, not accuracy.
# An objective's own metrics are named from these families too (flyscale.api.higher_is_better).
LOWER_IS_BETTER = (
    "*_drop",
    "*_increase",
    "loss",
    "ece",
    "size_bytes",
    "latency_*",
    "*error",
    "*abs_diff",
    "perplexity",
    "bits_per_*",
    "mae",
    "mse",
    "rmse",
)
HIGHER_IS_BETTER = (
    "accuracy",
    "macro_f1",
    "precision*",
    "recall*",
    "throughput*",
    "speedup*",
    "size_ratio",
    "r2",
    "*_per_s",
    "*score",
)


def higher_is_better(metric_name: str) -> bool:
    """True when a larger value of `metric_name` is better, False when a smaller one is.

    A name may carry prefixes ("test_", "int8_test_", "val_"): the family is the name itself or
    what follows any of its underscores, e.g. "int8_test_latency_p99_ms_b64" is a latency
    (lower is better) and "int8_accuracy_drop" a drop (lower is better). A name outside
    LOWER_IS_BETTER and HIGHER_IS_BETTER raises ValueError: guessing a direction would let a
    comparison silently prefer the worse model.
    """
    parts = metric_name.split("_")
    tails = ["_".join(parts[i:]) for i in range(len(parts))]  # the name, then without each prefix
    for tail in tails:
        for patterns, verdict in ((LOWER_IS_BETTER, False), (HIGHER_IS_BETTER, True)):
            if any(fnmatch.fnmatchcase(tail, p) for p in patterns):
                return verdict
    raise ValueError(
        f"no known direction for metric {metric_name!r}: lower is better for {', '.join(LOWER_IS_BETTER)}; "
        f"higher is better for {', '.join(HIGHER_IS_BETTER)} (a name may carry prefixes such as 'test_')"
    )


def state_dict_bytes(model: nn.Module) -> int:
    """Size of the model as it is stored (packed int8 weights count as int8)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def reliability(
    confidence: np.ndarray, correct: np.ndarray, bins: int = CALIBRATION_BINS
) -> tuple[float, list[float], list[float], list[int]]:
    """(ECE, per-bin mean confidence, per-bin accuracy, per-bin count) over equal-width bins.

    Bin k holds confidences in (k/bins, (k+1)/bins], the first also 0: the standard definition,
    ECE = sum over bins of |bin| / n * |accuracy(bin) - confidence(bin)|.
    """
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    # side="left": a confidence equal to an inner edge belongs to the bin that edge closes.
    which = np.clip(np.searchsorted(edges[1:-1], confidence, side="left"), 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    conf_sum = np.bincount(which, weights=confidence, minlength=bins)
    hit_sum = np.bincount(which, weights=correct, minlength=bins)
    safe = np.maximum(count, 1)
    mean_conf, acc = conf_sum / safe, hit_sum / safe
    ece = float(np.sum(count * np.abs(acc - mean_conf)) / max(len(confidence), 1))
    return ece, mean_conf.tolist(), acc.tolist(), count.astype(int).tolist()


def confusion_matrix(truth: np.ndarray, pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts of (true class, predicted class) pairs, classes 0..num_classes-1.

    Ours, not scikit-learn's: its import costs every run that evaluates 2-3 s. The tests hold
    this and `macro_f1` to scikit-learn's numbers.
    """
    truth, pred = np.asarray(truth, dtype=np.int64), np.asarray(pred, dtype=np.int64)
    inside = (truth >= 0) & (truth < num_classes) & (pred >= 0) & (pred < num_classes)
    pairs = truth[inside] * num_classes + pred[inside]
    return np.bincount(pairs, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def macro_f1(confusion: np.ndarray) -> float:
    """The unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN), 0 for a class never seen nor predicted."""
    confusion = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(confusion)
    denominator = confusion.sum(axis=0) + confusion.sum(axis=1)  # (TP + FP) + (TP + FN)
    f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator > 0)
    return float(f1.mean()) if len(f1) else 0.0


def per_class_precision_recall(confusion: np.ndarray) -> tuple[list[float], list[float]]:
    """Precision (by predicted column) and recall (by true row) of each class; 0 where undefined."""
    confusion = np.asarray(confusion, dtype=np.float64)
    hits = np.diag(confusion)
    predicted, actual = confusion.sum(axis=0), confusion.sum(axis=1)
    precision = np.divide(hits, predicted, out=np.zeros_like(hits), where=predicted > 0)
    recall = np.divide(hits, actual, out=np.zeros_like(hits), where=actual > 0)
    return precision.tolist(), recall.tolist()


PLOTTED = 2000  # a regressor's predictions kept for the residual plot


class ClassificationEvaluator:
    """Accuracy, macro-F1, per-class precision and recall, calibration and the confusion matrix,
    streamed: memory holds, per example, the prediction, the label and the top-class confidence."""

    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.loss_sum, self.preds, self.truths, self.confs = 0.0, [], [], []  # type: ignore[var-annotated]

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.loss_sum += float(nn.functional.cross_entropy(logits, targets, reduction="sum"))
        conf, top = torch.softmax(logits.float(), dim=1).max(dim=1)
        self.preds.append(top.numpy())
        self.confs.append(conf.numpy())
        self.truths.append(targets.numpy())

    def result(self) -> EvalMetrics:
        pred = np.concatenate(self.preds) if self.preds else np.zeros(0, dtype=np.int64)
        truth = np.concatenate(self.truths) if self.truths else np.zeros(0, dtype=np.int64)
        confs = np.concatenate(self.confs) if self.confs else np.zeros(0)
        confusion = confusion_matrix(truth, pred, self.num_classes)
        precision, recall = per_class_precision_recall(confusion)
        ece, bin_conf, bin_acc, bin_count = reliability(confs, pred == truth)
        return EvalMetrics(
            accuracy=float(np.mean(pred == truth)) if len(truth) else 0.0,
            macro_f1=macro_f1(confusion),
            loss=self.loss_sum / max(len(truth), 1),
            n=len(truth),
            confusion=confusion.tolist(),
            size_bytes=0,
            precision=precision,
            recall=recall,
            ece=ece,
            reliability_confidence=bin_conf,
            reliability_accuracy=bin_acc,
            reliability_count=bin_count,
        )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> EvalMetrics:
    """A classifier's metrics on (x, y), 1,024 rows at a time."""
    rows = ((x[i : i + 1024], y[i : i + 1024]) for i in range(0, len(y), 1024))
    evaluator = ClassificationEvaluator(num_classes)
    model.eval()
    for xb, yb in rows:
        evaluator.update(model(xb), yb)
    metrics = evaluator.result()
    metrics.size_bytes = state_dict_bytes(model)
    return metrics


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], objective: Any, context: Any
) -> EvalMetrics:
    """The objective's metrics of `model` over batches as they come (one batch in memory at a
    time), its samples (a language model's continuations), and the model's stored size.
    `context` is the objective's ObjectiveContext."""
    model.eval()
    evaluator = objective.evaluator(context)
    pair = getattr(objective, "pair", None)
    for xb, yb in batches:
        if pair is not None:
            xb, yb = pair(xb, yb)
        evaluator.update(model(xb), yb)
    metrics = evaluator.result()
    samples = getattr(objective, "samples", None)
    if samples is not None:
        metrics.samples = dict(samples(model, context))
    metrics.size_bytes = state_dict_bytes(model)
    return metrics
