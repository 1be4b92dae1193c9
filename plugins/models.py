"""Built-in models. Each is an `nn.Sequential` of whole layers, so the pipeline strategy can
cut it into stages at layer boundaries. Inputs always arrive flattened, (N, features)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from flyscale.api import DatasetInfo


@dataclass
class MLPOptions:
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    dropout: float = 0.1

    def __post_init__(self):
        if not self.hidden or any(h <= 0 for h in self.hidden):
            raise ValueError(f"hidden must be a non-empty list of positive sizes, got {self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class MLP:
    """Fully connected layers with ReLU and dropout."""

    options_type = MLPOptions

    def build(self, options: MLPOptions, info: DatasetInfo) -> nn.Sequential:
        layers: list[nn.Module] = []
        width = math.prod(info.input_shape)
        for h in options.hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(options.dropout)]
            width = h
        layers.append(nn.Linear(width, info.num_classes))
        return nn.Sequential(*layers)


@dataclass
class CNNOptions:
    channels: list[int] = field(default_factory=lambda: [32, 64])
    hidden: int = 128
    dropout: float = 0.1

    def __post_init__(self):
        if not self.channels or any(c <= 0 for c in self.channels):
            raise ValueError(f"channels must be a non-empty list of positive sizes, got {self.channels}")
        if self.hidden <= 0:
            raise ValueError(f"hidden must be > 0, got {self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CNN:
    """3x3 convolutions (same padding) then a small classifier head."""

    options_type = CNNOptions

    def build(self, options: CNNOptions, info: DatasetInfo) -> nn.Sequential:
        if len(info.input_shape) != 3:
            raise ValueError(f"model 'cnn' needs image inputs (C, H, W); dataset {info.name!r} has {info.input_shape}")
        c, h, w = info.input_shape
        layers: list[nn.Module] = [nn.Unflatten(1, (c, h, w))]
        for out in options.channels:
            layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.ReLU()]
            c = out
        layers += [
            nn.Flatten(),
            nn.Linear(c * h * w, options.hidden),
            nn.ReLU(),
            nn.Dropout(options.dropout),
            nn.Linear(options.hidden, info.num_classes),
        ]
        return nn.Sequential(*layers)


mlp = MLP()
cnn = CNN()
