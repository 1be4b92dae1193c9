"""Models between tasks travel as state_dict files, loaded with `weights_only=True`
(never pickled modules: flytekit's torch transformers unpickle, and torch>=2.6 refuses that)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

from flyscale.config import ModelConfig, QuantizeConfig, TrainConfig
from plugins import registry
from plugins.protocols import DatasetInfo, parse_options


def build_model(cfg: ModelConfig, info: DatasetInfo) -> nn.Module:
    """A freshly initialised model from the configured plugin."""
    plugin = registry.models.get(cfg.name)
    return plugin.build(parse_options(plugin, cfg.options, "model.options"), info)


def strategy(cfg: TrainConfig) -> tuple[Any, Any]:
    """The configured training strategy function and its parsed options."""
    fn = registry.strategies.get(cfg.strategy)
    return fn, parse_options(fn, cfg.options, "train.options")


def quantize(model: nn.Module, cfg: QuantizeConfig) -> nn.Module:
    """A quantized copy of `model` by the configured quantizer."""
    plugin = registry.quantizers.get(cfg.name)
    return plugin.quantize(model, parse_options(plugin, cfg.options, "quantize.options"))


def save_state(model: nn.Module, name: str) -> str:
    """Write `model`'s state_dict to a fresh file that outlives this process; returns its path."""
    path = os.path.join(tempfile.mkdtemp(prefix="flyscale-"), name)
    torch.save(model.state_dict(), path)
    return path


def load_state(model: nn.Module, path: str) -> nn.Module:
    """Load weights saved by `save_state` into `model` (same architecture)."""
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()
