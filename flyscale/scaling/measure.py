"""What a study fits, measured on one split: through the objective's `score`, so it means the
same for any objective.

- "error" (a classifier's): 1 - hits / count, with the binomial standard error over the count;
- "loss" (anyone else's, a language model's): summed loss / count, the mean loss per counted
  target (nats per token), with the standard error of the mean over blocks of consecutive
  examples. Blocks, not single examples: neighbouring sequences of one document are not
  independent draws, and a block's mean absorbs what they share.

The objective says which (`scaling_metric`, default "loss"), and what its count counts (`unit`,
default "example"; a language model's is "token"): the data axis of its study is then tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from flyscale.train.objective import pairing

BLOCK = 8  # consecutive examples per block of the loss's standard error
CHUNK = 64  # examples per forward pass: memory holds one chunk's outputs, never a row group's


@dataclass
class Measured:
    """The study's metric on one split."""

    value: float
    noise: float  # its standard error: what the same model would show on another sample
    count: int  # targets scored: examples, or tokens
    examples: int


def metric_of(objective: Any) -> str:
    """The metric a study of `objective` fits: "error" or "loss"."""
    metric = getattr(objective, "scaling_metric", "loss")
    if metric not in ("error", "loss"):
        raise ValueError(
            f"objective {type(objective).__name__}: scaling_metric must be 'error' or 'loss', got {metric!r}"
        )
    return metric


def unit_of(objective: Any) -> str:
    """What the objective's score counts: "example", or "token" for a language model."""
    return str(getattr(objective, "unit", "example"))


def binomial_noise(error: float, count: int) -> float:
    """The binomial standard error of an error rate measured on `count` targets (0 when unknown)."""
    return math.sqrt(max(error * (1 - error), 0.0) / count) if count > 0 else 0.0


@torch.no_grad()
def measure(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], objective: Any) -> Measured:
    """The study's metric of `model` (in eval mode) over `batches`, and its standard error."""
    model.eval()
    losses, hits, counts, examples = [], [], [], 0
    pair = pairing(objective)
    for xb, yb in batches:
        for x, y in zip(torch.split(xb, CHUNK), torch.split(yb, CHUNK), strict=True):
            if pair is not None:
                x, y = pair(x, y)
            out = model(x)
            for start in range(0, len(x), BLOCK):
                loss, hit, count = objective.score(out[start : start + BLOCK], y[start : start + BLOCK])
                losses.append(float(loss))
                hits.append(float(hit))
                counts.append(int(count))
            examples += len(x)
    total = int(sum(counts))
    if total == 0:
        raise ValueError("the split has no targets to score: a study cannot measure a point on it")
    if metric_of(objective) == "error":
        error = 1.0 - sum(hits) / total
        return Measured(error, binomial_noise(error, total), total, examples)
    c = np.asarray(counts, dtype=float)
    means = np.asarray(losses) / c
    value = float(np.sum(losses) / total)
    # The weighted batch-means standard error: blocks weigh by the targets they hold.
    w = c / c.sum()
    n = len(c)
    noise = math.sqrt(float(np.sum(w**2 * (means - value) ** 2)) * n / (n - 1)) if n > 1 else 0.0
    return Measured(value, noise, total, examples)
