"""The regression objective: real-valued targets, one or several per example.

The model's outputs are its predictions, in the targets' own units: nothing is standardised
behind the model's back, so what the served model returns needs no undoing. A dataset declares
how many target values each example has as its `num_classes` (the width of the model's output):
a scalar target is 1, and the model's (N, 1) or (N,) is scored against targets (N,); k targets
per example are (N, k) against (N, k).

Training follows the mean squared error (or the mean absolute error, `loss: mae`); evaluation
streams MAE, RMSE and R² (the share of the targets' variance the model explains: 1 is perfect, 0
is no better than predicting their mean), averaged over targets as scikit-learn's
`uniform_average` does, and keeps a sample of (predicted, actual) pairs of the first target for
the residual plot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flyscale.api import PLOTTED, EvalMetrics, ObjectiveContext

LOSSES = ("mse", "mae")


@dataclass
class RegressionOptions:
    loss: str = "mse"  # what training follows: "mse" (squared error) or "mae" (absolute error)

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")


def aligned(
    outputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions, targets) both (N, k) in `dtype`: a scalar target (N,) is one column, and so
    is a model's (N,). Squared errors in target units overflow half precision (300² > 65,504),
    so the arithmetic is at least float32 whatever the model computed in."""
    p = outputs.to(dtype)
    y = targets.to(dtype)
    p = p[:, None] if p.dim() == 1 else p
    y = y[:, None] if y.dim() == 1 else y
    if p.dim() != 2 or p.shape != y.shape:
        raise ValueError(
            f"regression: the model's outputs {tuple(outputs.shape)} do not fit the targets {tuple(targets.shape)}: "
            f"for k target values per example it must output (N, k), for one (N, 1) or (N,); the model's output "
            f"width is the dataset's num_classes, which a regression dataset sets to its number of targets"
        )
    return p, y


class RegressionEvaluator:
    """MAE, RMSE and R² over the test split, streamed: per target, running sums (of the errors, and
    of the targets about a shift, for the variance R² divides by); and a uniform sample of at most
    PLOTTED (predicted, actual) pairs of the first target, the same however the split is batched."""

    def __init__(self, loss: str, seed: int = 0):
        self.loss = loss
        self.rows = 0
        self.shift: np.ndarray | None = None  # the first batch's mean target: keeps the sums small
        empty = np.zeros(0)
        self.sum_y, self.sum_y2, self.sse, self.sae = empty, empty, empty, empty
        self.rng = np.random.default_rng(seed)
        self.keys = np.zeros(0)  # the sample's random keys: it keeps the pairs of the PLOTTED smallest
        self.pairs = np.zeros((0, 2))  # (predicted, actual), in the split's order

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        p, y = (t.detach().cpu().numpy() for t in aligned(outputs, targets, torch.float64))
        if self.shift is None:
            self.shift = y.mean(axis=0)
            self.sum_y, self.sum_y2, self.sse, self.sae = (np.zeros(y.shape[1]) for _ in range(4))
        if y.shape[1] != len(self.shift):
            raise ValueError(f"regression: a batch of {y.shape[1]} targets per example after {len(self.shift)}")
        centred, error = y - self.shift, p - y
        self.sum_y += centred.sum(axis=0)
        self.sum_y2 += (centred**2).sum(axis=0)
        self.sse += (error**2).sum(axis=0)
        self.sae += np.abs(error).sum(axis=0)
        self._sample(p[:, 0], y[:, 0])
        self.rows += len(y)

    def _sample(self, predicted: np.ndarray, actual: np.ndarray) -> None:
        """Bottom-k of a random key per example: a uniform sample without replacement, drawn as the
        batches come (one key per example in order, so the batching does not change it)."""
        keys = np.concatenate([self.keys, self.rng.random(len(actual))])
        pairs = np.concatenate([self.pairs, np.stack([predicted, actual], axis=1)])
        keep = np.sort(np.argsort(keys, kind="stable")[:PLOTTED]) if len(keys) > PLOTTED else slice(None)
        self.keys, self.pairs = keys[keep], pairs[keep]

    def result(self) -> EvalMetrics:
        n = self.rows
        if self.shift is None or n == 0:
            values, loss = {"mae": 0.0, "rmse": 0.0, "r2": 0.0}, 0.0
        else:
            sst = self.sum_y2 - self.sum_y**2 / n
            # As scikit-learn's r2_score: a constant target is explained perfectly or not at all.
            r2 = np.where(sst > 0, 1 - self.sse / np.where(sst > 0, sst, 1), np.where(self.sse == 0, 1.0, 0.0))
            values = {
                "mae": float(np.mean(self.sae / n)),
                "rmse": float(np.mean(np.sqrt(self.sse / n))),
                "r2": float(np.mean(r2)),
            }
            loss = float((self.sse if self.loss == "mse" else self.sae).sum() / (n * len(self.shift)))
        return EvalMetrics(
            accuracy=0.0,
            macro_f1=0.0,
            loss=loss,
            n=n,
            confusion=[],
            size_bytes=0,
            objective="regression",
            values=values,
            predicted=self.pairs[:, 0].tolist(),
            actual=self.pairs[:, 1].tolist(),
        )


class Regression:
    """Predictions (N, k) or (N,) against real-valued targets of the same shape ((N,) for one)."""

    options_type = RegressionOptions
    real_valued = True  # the dataset's label must be a float field: a class id is no target
    metrics = {"mae": False, "rmse": False, "r2": True}
    headline = "r2"

    def __init__(self, options: RegressionOptions | None = None):
        self.options = options or RegressionOptions()

    def with_options(self, options: RegressionOptions) -> Regression:
        return Regression(options)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        p, y = aligned(outputs, targets)
        return F.mse_loss(p, y) if self.options.loss == "mse" else F.l1_loss(p, y)

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The summed loss over every target value, no hits (there are no classes to hit), and how
        many target values there were: validation's loss is then the mean per target value."""
        p, y = aligned(outputs, targets)
        summed = F.mse_loss(p, y, reduction="sum") if self.options.loss == "mse" else F.l1_loss(p, y, reduction="sum")
        return summed, torch.zeros((), dtype=torch.long, device=p.device), y.numel()

    def evaluator(self, context: ObjectiveContext) -> RegressionEvaluator:
        return RegressionEvaluator(self.options.loss)

    def serving(self, context: ObjectiveContext) -> dict:
        return {"output": "values", "scalar": _scalar(context)}

    def predict(self, model: nn.Module, model_input, params: dict, context: ObjectiveContext) -> np.ndarray:
        """The predictions, in the targets' units, for float32 inputs of the declared shape: one
        value per example (N,) for a scalar target, (N, k) for k targets. It takes no params."""
        if params:
            raise ValueError(f"unknown params {sorted(params)}: a regression model takes none")
        x = torch.as_tensor(np.asarray(model_input, dtype="float32"))
        model.eval()
        with torch.inference_mode():
            out = model(x).float()
        return (out.reshape(len(out)) if _scalar(context) and out.dim() == 2 and out.shape[1] == 1 else out).numpy()


def _scalar(context: ObjectiveContext) -> bool:
    """Whether the target is one value an example (served as (N,), not (N, 1))."""
    target = next((f for f in context.info.fields if f.name == context.info.label_column), None)
    return target is not None and not target.shape


regression = Regression()
