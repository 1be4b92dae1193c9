"""The training strategy, chosen by name in `train.strategy`: a plugin function applied to the
model (`ddp`, `pipeline`, or a third party's)."""

from __future__ import annotations

from typing import Any

from flyscale.config import TrainConfig


def strategy(cfg: TrainConfig) -> tuple[Any, Any]:
    """The configured training strategy function and its parsed options."""
    return cfg.plugin.plugin, cfg.plugin.options


def wants_meta_model(cfg: TrainConfig) -> bool:
    """Whether the configured strategy takes its model on the meta device (`meta_model = True`)."""
    return bool(cfg.plugin.attribute("meta_model"))
