"""The objective training follows and validation measures: a plugin (the objectives kind,
flyscale/plugin/objective_protocol.py ObjectivePlugin), found by name like every other. Classification is
the default wherever none is given, so code written before objectives existed trains as it did."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flyscale.config import ObjectiveConfig
from flyscale.plugin import registry


def of(cfg: ObjectiveConfig) -> Any:
    """The configured objective: the plugin, bound to its options where it takes them."""
    resolved = cfg.plugin
    bind = getattr(resolved.plugin, "with_options", None)
    return bind(resolved.options) if bind is not None and resolved.options is not None else resolved.plugin


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
