"""Built-in models. Each is an `nn.Sequential` of whole layers, so the pipeline strategy can
cut it into stages at layer boundaries. Inputs arrive as the dataset declares them: a typed
field at its shape ((N, 3, 32, 32) for an image), a table's features flattened (N, features)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from flyscale.api import DatasetInfo


def _scaled_widths(widths: list[int], multiplier: float, name: str) -> list[int]:
    """Each width times `multiplier`, rounded half up; a width that rounds to 0 is an error."""
    out = [math.floor(w * multiplier + 0.5) for w in widths]
    if any(w < 1 for w in out):
        raise ValueError(
            f"width_multiplier {multiplier:g} leaves a layer of {name} {widths} with no units "
            f"({out}); use a multiplier of at least {0.5 / min(widths):.3g}"
        )
    return out


def _scaled_depth(layers: list[int], multiplier: float, name: str) -> list[int]:
    """`layers` resampled to round(len x multiplier) layers, keeping their order of widths: the
    first layers' widths repeat when deeper ([256, 128] x2 -> [256, 256, 128, 128]), the later
    ones go first when shallower ([256, 128] x0.5 -> [256])."""
    count = math.floor(len(layers) * multiplier + 0.5)
    if count < 1:
        raise ValueError(
            f"depth_multiplier {multiplier:g} leaves none of the {len(layers)} layers of {name} "
            f"{layers}; use a multiplier of at least {0.5 / len(layers):.3g}"
        )
    return [layers[i * len(layers) // count] for i in range(count)]


def _check_multipliers(options) -> None:
    for name in ("width_multiplier", "depth_multiplier"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0 (1 = the sizes as given), got {value!r}")


@dataclass
class MLPOptions:
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    dropout: float = 0.1
    # Model size as one number each, for scaling studies: every hidden width times width_multiplier,
    # and round(len(hidden) x depth_multiplier) hidden layers. 1 builds `hidden` exactly.
    width_multiplier: float = 1.0
    depth_multiplier: float = 1.0

    def __post_init__(self):
        if not self.hidden or any(h <= 0 for h in self.hidden):
            raise ValueError(f"hidden must be a non-empty list of positive sizes, got {self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_multipliers(self)
        self.layers()  # a multiplier that leaves a layer empty fails here, before any work

    def layers(self) -> list[int]:
        """The hidden widths the multipliers give."""
        return _scaled_widths(
            _scaled_depth(self.hidden, self.depth_multiplier, "hidden"), self.width_multiplier, "hidden"
        )


class MLP:
    """Fully connected layers with ReLU and dropout."""

    options_type = MLPOptions

    def build(self, options: MLPOptions, info: DatasetInfo) -> nn.Sequential:
        field = info.input()
        if field is not None and field.dtype in ("int32", "int64"):  # uint8 pixels arrive as floats
            raise ValueError(
                f"model 'mlp' reads numbers, and dataset {info.name!r}'s input is token ids ({field}), which it "
                f"cannot embed: fine-tune a model that reads tokens (model: huggingface, docs/huggingface.md)"
            )
        # An image field arrives (N, C, H, W): flatten it first. A table's features are already flat.
        layers: list[nn.Module] = [nn.Flatten()] if info.input() is not None and len(info.input_shape) > 1 else []
        width = math.prod(info.input_shape)
        for h in options.layers():
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(options.dropout)]
            width = h
        layers.append(nn.Linear(width, info.num_classes))
        return nn.Sequential(*layers)


@dataclass
class CNNOptions:
    channels: list[int] = field(default_factory=lambda: [32, 64])
    hidden: int = 128
    dropout: float = 0.1
    # As for the MLP: every channel count and the hidden width times width_multiplier, and
    # round(len(channels) x depth_multiplier) convolutions. 1 builds the sizes as given.
    width_multiplier: float = 1.0
    depth_multiplier: float = 1.0

    def __post_init__(self):
        if not self.channels or any(c <= 0 for c in self.channels):
            raise ValueError(f"channels must be a non-empty list of positive sizes, got {self.channels}")
        if self.hidden <= 0:
            raise ValueError(f"hidden must be > 0, got {self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_multipliers(self)
        self.sizes()  # a multiplier that leaves a layer empty fails here, before any work

    def sizes(self) -> tuple[list[int], int]:
        """(channels, hidden) as the multipliers give them."""
        channels = _scaled_widths(
            _scaled_depth(self.channels, self.depth_multiplier, "channels"), self.width_multiplier, "channels"
        )
        return channels, _scaled_widths([self.hidden], self.width_multiplier, "hidden")[0]


class CNN:
    """3x3 convolutions (same padding) then a small classifier head."""

    options_type = CNNOptions

    def build(self, options: CNNOptions, info: DatasetInfo) -> nn.Sequential:
        if len(info.input_shape) != 3:
            raise ValueError(f"model 'cnn' needs image inputs (C, H, W); dataset {info.name!r} has {info.input_shape}")
        c, h, w = info.input_shape
        channels, hidden = options.sizes()
        # A table of pixels (digits' 64 columns) arrives flat, (N, C*H*W); an image field as (N, C, H, W).
        layers: list[nn.Module] = [] if info.input() is not None else [nn.Unflatten(1, (c, h, w))]
        for out in channels:
            layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.ReLU()]
            c = out
        layers += [
            nn.Flatten(),
            nn.Linear(c * h * w, hidden),
            nn.ReLU(),
            nn.Dropout(options.dropout),
            nn.Linear(hidden, info.num_classes),
        ]
        return nn.Sequential(*layers)


NORMS = ("batch", "group")


@dataclass
class ResNetOptions:
    widths: list[int] = field(default_factory=lambda: [16, 32, 64])  # channels of each stage
    blocks: list[int] = field(default_factory=lambda: [1, 1, 1])  # BasicBlocks in each stage
    # "batch", or "group" for the pipeline strategy, which refuses BatchNorm's running statistics.
    norm: str = "batch"
    dropout: float = 0.0  # before the final Linear
    # Every width times width_multiplier, and each stage's blocks times depth_multiplier (rounded
    # half up); 1 builds the sizes as given.
    width_multiplier: float = 1.0
    depth_multiplier: float = 1.0

    def __post_init__(self):
        if not self.widths or any(w <= 0 for w in self.widths):
            raise ValueError(f"widths must be a non-empty list of positive sizes, got {self.widths}")
        if len(self.blocks) != len(self.widths) or any(b <= 0 for b in self.blocks):
            raise ValueError(
                f"blocks must give a positive count for each of the {len(self.widths)} stages of widths "
                f"{self.widths}, got {self.blocks}"
            )
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_multipliers(self)
        self.stages()  # a multiplier that leaves a layer empty fails here, before any work

    def stages(self) -> list[tuple[int, int]]:
        """(width, blocks) of each stage, as the multipliers give them."""
        widths = _scaled_widths(self.widths, self.width_multiplier, "widths")
        blocks = [math.floor(b * self.depth_multiplier + 0.5) for b in self.blocks]
        if min(blocks) < 1:  # a stage's first block is where it widens and halves the size
            raise ValueError(
                f"depth_multiplier {self.depth_multiplier:g} leaves a stage of blocks {self.blocks} with no "
                f"blocks ({blocks}); use a multiplier of at least {0.5 / min(self.blocks):.3g}"
            )
        return list(zip(widths, blocks))


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    # Groups of several channels (up to 8 groups): per-example statistics, nothing kept between batches.
    return nn.GroupNorm(max(g for g in range(1, 9) if channels % g == 0), channels)


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)  # the norm adds the bias


class BasicBlock(nn.Module):
    """Two 3x3 convolutions plus a shortcut, then ReLU (He et al., 2016): one layer of the Sequential."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.body = nn.Sequential(
            _conv3x3(c_in, c_out, stride), _norm(norm, c_out), nn.ReLU(), _conv3x3(c_out, c_out), _norm(norm, c_out)
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # a 1x1 convolution brings the input to the body's shape
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out))
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet:
    """A small ResNet: a 3x3 stem, stages of BasicBlocks (each after the first halves the size),
    global average pooling and a linear classifier."""

    options_type = ResNetOptions

    def build(self, options: ResNetOptions, info: DatasetInfo) -> nn.Sequential:
        if len(info.input_shape) != 3:
            raise ValueError(
                f"model 'resnet' needs image inputs (C, H, W); dataset {info.name!r} has {info.input_shape}"
            )
        c, h, w = info.input_shape
        stages = options.stages()
        # No initialisation beyond torch's layers' own reset_parameters(): that is all a strategy
        # re-runs when it materialises a layer from the meta device (flyscale.train.meta).
        layers: list[nn.Module] = [] if info.input() is not None else [nn.Unflatten(1, (c, h, w))]
        width = stages[0][0]
        layers += [_conv3x3(c, width), _norm(options.norm, width), nn.ReLU()]
        for i, (out, blocks) in enumerate(stages):
            for b in range(blocks):
                layers.append(BasicBlock(width, out, 2 if i > 0 and b == 0 else 1, options.norm))
                width = out
        layers += [
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(options.dropout),
            nn.Linear(width, info.num_classes),
        ]
        return nn.Sequential(*layers)


mlp = MLP()
cnn = CNN()
resnet = ResNet()
