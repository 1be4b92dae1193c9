"""Validation during training: loss and accuracy over this rank's disjoint share of the
validation split, as the run's objective scores them, summed over ranks by the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flyscale.data.fields import Reader
from flyscale.data.shards import Unit
from flyscale.data.streaming import unit_batches
from flyscale.train.distributed import DistContext
from flyscale.train.objective import default, scored

log = logging.getLogger(__name__)


# An evaluation returns (summed loss, number correct, count) over this rank's share of the val set.
EvalFn = Callable[[], tuple[float, float, float]]


def evaluate_split(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    ctx: DistContext,
    batch_size: int = 1024,
    objective: Any = None,
) -> EvalFn:
    """An EvalFn over this rank's disjoint share of (x, y), scored by `objective` (classification
    when None): the count is of what it scores, examples or tokens."""
    objective = objective or default()

    @torch.no_grad()
    def run() -> tuple[float, float, float]:
        was_training = model.training
        model.eval()
        idx = torch.tensor(list(ctx.eval_indices(len(y))), dtype=torch.long)
        loss_sum = correct = count = 0.0
        for start in range(0, len(idx), batch_size):
            sel = idx[start : start + batch_size]
            batch_loss, batch_correct, n = scored(objective, model, x[sel].to(ctx.device), y[sel].to(ctx.device))
            loss_sum, correct, count = loss_sum + batch_loss, correct + batch_correct, count + n
        model.train(was_training)
        return loss_sum, correct, count

    return run


def evaluate_units(
    model: torch.nn.Module,
    units: list[Unit],
    reader: Reader,
    rank: int,
    world: int,
    device: torch.device,
    objective: Any = None,
) -> tuple[float, float, float]:
    """(summed loss, correct, count) over this rank's disjoint share of the row groups."""
    objective = objective or default()
    was_training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    for xb, yb in unit_batches(units[rank::world], reader):
        batch_loss, batch_correct, n = scored(objective, model, xb.to(device), yb.to(device))
        loss_sum, correct, count = loss_sum + batch_loss, correct + batch_correct, count + n
    model.train(was_training)
    return loss_sum, correct, count
