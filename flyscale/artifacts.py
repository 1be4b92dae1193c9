"""Models between tasks travel as state_dict files, loaded with `weights_only=True`
(never pickled modules: flytekit's torch transformers unpickle, and torch>=2.6 refuses that)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from typing import Any, Sequence

import torch
from torch import nn

from flyscale.config import ModelConfig, QuantizeConfig, TrainConfig
from flyscale.contracts import DatasetInfo


def _module(value: Any, what: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{what} returned {type(value).__name__}, expected a torch.nn.Module")
    return value


def build_model(cfg: ModelConfig, info: DatasetInfo, *, meta: bool = False) -> nn.Module:
    """A freshly initialised model from the configured plugin; `meta`: shapes only, on the meta
    device, for a strategy that materialises its own part (flyscale.meta)."""
    r = cfg.plugin
    with torch.device("meta") if meta else contextlib.nullcontext():
        return _module(r.plugin.build(r.options, info), f"model {cfg.name!r}: build()")


def strategy(cfg: TrainConfig) -> tuple[Any, Any]:
    """The configured training strategy function and its parsed options."""
    return cfg.plugin.plugin, cfg.plugin.options


def wants_meta_model(cfg: TrainConfig) -> bool:
    """Whether the configured strategy takes its model on the meta device (`meta_model = True`)."""
    return bool(cfg.plugin.attribute("meta_model"))


def quantize(model: nn.Module, cfg: QuantizeConfig, calibration: Sequence[torch.Tensor] | None = None) -> nn.Module:
    """A quantized copy of `model` by the configured quantizer.

    `calibration`: float32 feature batches of the training split, (batch, n_features) each, for
    a quantizer that calibrates (`calibrates = True`); others never see it.
    """
    r = cfg.plugin
    where = f"quantizer {cfg.name!r}"
    if not r.attribute("calibrates"):
        return _module(r.plugin.quantize(model, r.options), f"{where}: quantize()")
    if not calibration:
        raise ValueError(
            f"{where} calibrates on data: pass calibration, a list of float32 feature batches "
            "(batch, n_features) from the training split (e.g. flyscale.data.calibration_batches)"
        )
    return _module(r.plugin.quantize(model, r.options, list(calibration)), f"{where}: quantize()")


def rebuild_quantized(model: nn.Module, cfg: QuantizeConfig, info: DatasetInfo) -> nn.Module:
    """An empty int8 module of `model`'s quantized architecture, to `load_state` saved int8 weights into.

    A calibrating quantizer is calibrated on a synthetic batch of the right shape: the real
    scales and zero points are buffers of the saved state_dict and replace these on loading.
    """
    calibration = None
    if cfg.plugin.attribute("calibrates"):
        g = torch.Generator().manual_seed(0)
        calibration = [torch.randn(8, len(info.feature_columns), generator=g)]
    return quantize(model, cfg, calibration)


def save_state(model: nn.Module, name: str) -> str:
    """Write `model`'s state_dict to a fresh file that outlives this process; returns its path."""
    path = os.path.join(tempfile.mkdtemp(prefix="flyscale-"), name)
    torch.save(model.state_dict(), path)
    return path


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes: the identity of a weights file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_state(model: nn.Module, path: str) -> nn.Module:
    """Load weights saved by `save_state` into `model` (same architecture)."""
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()
