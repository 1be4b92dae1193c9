"""`acme_max_loss` (a gate on test loss, lower is better) and `acme_linear` (a linear classifier),
annotated with flyscale's Protocols and returning flyscale's own types."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from flyscale.api import DatasetInfo, GatePlugin, GateVerdict, ModelPlugin


@dataclass
class MaxLossOptions:
    max_loss: float = 0.5

    def __post_init__(self):
        if self.max_loss <= 0:
            raise ValueError(f"max_loss must be > 0, got {self.max_loss}")


class MaxLoss(GatePlugin):
    options_type = MaxLossOptions

    def check(self, metrics: Mapping[str, float], options: MaxLossOptions, champion) -> GateVerdict:
        loss = metrics["loss"]
        passed = loss <= options.max_loss
        return GateVerdict(
            "acme_max_loss", passed, f"test loss {loss:.4f} {'<=' if passed else '>'} {options.max_loss}"
        )


class Linear(ModelPlugin):
    def build(self, options: None, info: DatasetInfo) -> nn.Sequential:
        return nn.Sequential(nn.Linear(math.prod(info.input_shape), info.num_classes))


max_loss = MaxLoss()
linear = Linear()
