"""`acme_tiny_mlp`: the smallest useful classifier, one hidden layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TinyMLPOptions:
    """The `model.options` section of a flyscale config, when `model.name` is acme_tiny_mlp."""

    width: int = 64

    def __post_init__(self):
        # flyscale validates options before any work starts; name the field so users can fix it.
        if self.width <= 0:
            raise ValueError(f"width must be > 0, got {self.width}")


class TinyMLP:
    """Linear -> ReLU -> Linear. Whole layers in an nn.Sequential, so pipeline parallelism can split it."""

    options_type = TinyMLPOptions

    def build(self, options: TinyMLPOptions, info) -> nn.Sequential:
        # `info` is flyscale's DatasetInfo; only its attributes are used, so no import is needed.
        features = math.prod(info.input_shape)
        return nn.Sequential(
            nn.Linear(features, options.width),
            nn.ReLU(),
            nn.Linear(options.width, info.num_classes),
        )


class NoBuild:
    """Deliberately the wrong shape: `biuld` instead of `build`. flyscale refuses it at lookup."""

    def biuld(self, options, info):
        raise AssertionError("never called")


class BatchNormMLP:
    """Linear -> BatchNorm -> ReLU -> Linear: fine under data parallelism; under the pipeline
    strategy a later stage sees only micro-batches, so flyscale refuses it before any data work."""

    def build(self, options, info) -> nn.Sequential:
        features = math.prod(info.input_shape)
        return nn.Sequential(nn.Linear(features, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, info.num_classes))


class Residual(nn.Module):
    """A plain nn.Module (a skip connection): data parallelism trains it, a pipeline cannot cut it."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.inner, self.head = nn.Linear(features, features), nn.Linear(features, classes)

    def forward(self, x):
        return self.head(x + self.inner(x).relu())


class ResidualModel:
    def build(self, options, info) -> nn.Module:
        return Residual(math.prod(info.input_shape), info.num_classes)


class Gated(nn.Module):
    """A forward that branches on the data's values: it trains like any model, and torch.export
    (hence the ONNX exporter) cannot trace it."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        if x.abs().sum() > 0:
            return self.net(x)
        return self.net(x).detach() * 0


class GatedModel:
    def build(self, options, info) -> nn.Module:
        return Gated(math.prod(info.input_shape), info.num_classes)


class RunningMax(nn.Module):
    """Features as running maxima (torch.cummax): torch.export traces it, ONNX has no such operator."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.net(torch.cummax(x, dim=1).values)


class RunningMaxModel:
    def build(self, options, info) -> nn.Module:
        return RunningMax(math.prod(info.input_shape), info.num_classes)
