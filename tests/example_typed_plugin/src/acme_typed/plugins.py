"""`acme_max_loss` (a gate on test loss, lower is better), `acme_linear` (a linear classifier) and
`acme_replicated` (a training strategy in the parallelize form: the model in DDP), annotated with
flyscale's Protocols and returning flyscale's own types."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from flyscale.api import DatasetInfo, GatePlugin, GateVerdict, ModelPlugin, Parallelized, StrategyTraits


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


class Replicated:
    """Every worker trains the whole model on its share of each batch: only `parallelize` and
    `traits`; flyscale's trainer does the rest."""

    traits = StrategyTraits(per_worker_batch=True, reshards=True)  # its checkpoints are DCP's, as every one is

    def parallelize(self, model: nn.Module, data, cfg, ctx, options) -> Parallelized:
        if not ctx.distributed:
            return Parallelized("acme_replicated", model)
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        return Parallelized("acme_replicated", model, forward=wrapped, no_sync=wrapped.no_sync)


replicated = Replicated()
