"""Validation during training: loss and accuracy over this rank's disjoint share of the
validation split, summed over ranks by the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from flyscale.data.fields import Reader
from flyscale.data.shards import Unit
from flyscale.data.streaming import unit_batches
from flyscale.evaluate.metrics import batch_score
from flyscale.train.distributed import DistContext

log = logging.getLogger(__name__)


# An evaluation returns (summed loss, number correct, count) over this rank's share of the val set.
EvalFn = Callable[[], tuple[float, float, float]]


def evaluate_split(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: DistContext, batch_size: int = 1024
) -> EvalFn:
    """An EvalFn over this rank's disjoint share of (x, y)."""

    @torch.no_grad()
    def run() -> tuple[float, float, float]:
        was_training = model.training
        model.eval()
        idx = torch.tensor(list(ctx.eval_indices(len(y))), dtype=torch.long)
        loss_sum = correct = 0.0
        for start in range(0, len(idx), batch_size):
            sel = idx[start : start + batch_size]
            xb, yb = x[sel].to(ctx.device), y[sel].to(ctx.device)
            batch_loss, batch_correct = batch_score(model(xb), yb)
            loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
        model.train(was_training)
        return loss_sum, correct, float(len(idx))

    return run


def evaluate_units(
    model: torch.nn.Module,
    units: list[Unit],
    reader: Reader,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[float, float, float]:
    """(summed loss, correct, rows) over this rank's disjoint share of the row groups."""
    was_training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for xb, yb in unit_batches(units[rank::world], reader):
            xb, yb = xb.to(device), yb.to(device)
            batch_loss, batch_correct = batch_score(model(xb), yb)
            loss_sum, correct, count = loss_sum + batch_loss, correct + batch_correct, count + len(yb)
    model.train(was_training)
    return loss_sum, correct, count
