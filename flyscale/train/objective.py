"""The objective training follows and validation measures: a plugin (the objectives kind,
flyscale/plugin/contracts.py ObjectivePlugin), found by name like every other. Classification is
the default wherever none is given, so code written before objectives existed trains as it did."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flyscale.plugin import registry


def default() -> Any:
    """The classification objective."""
    return registry.objectives.get("classification")


def pairing(objective: Any):
    """The objective's `pair(x, y)`, or None when the model takes the inputs and is scored
    against the labels as they come (then a step calls nothing for it)."""
    return getattr(objective, "pair", None)


@torch.no_grad()
def scored(objective: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
    """(summed loss, hits, count) of one batch: what validation adds up."""
    pair = pairing(objective)
    if pair is not None:
        x, y = pair(x, y)
    loss, hits, count = objective.score(model(x), y)
    return float(loss), float(hits), int(count)
