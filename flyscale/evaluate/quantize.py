"""Post-training quantization by the configured quantizer plugin, and the empty int8
architecture that saved int8 weights load into."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flyscale.config import QuantizeConfig
from flyscale.data import fields
from flyscale.model import as_module
from flyscale.plugin.records import DatasetInfo

# The quantizer a convolutional model's int8 is tried with when the configured one does not pay:
# static QDQ quantizes the convolutions, which dynamic int8 leaves in fp32.
STATIC = "static_int8"


def quantize(model: nn.Module, cfg: QuantizeConfig, calibration: Sequence[torch.Tensor] | None = None) -> nn.Module:
    """A quantized copy of `model` by the configured quantizer.

    `calibration`: float32 feature batches of the training split, (batch, n_features) each, for
    a quantizer that calibrates (`calibrates = True`); others never see it.
    """
    r = cfg.plugin
    where = f"quantizer {cfg.name!r}"
    if works_on_onnx(cfg):
        raise ValueError(f"{where} quantizes the exported ONNX file, not a torch module: use quantize_onnx")
    if not r.attribute("calibrates"):
        return as_module(r.plugin.quantize(model, r.options), f"{where}: quantize()")
    if not calibration:
        raise ValueError(
            f"{where} calibrates on data: pass calibration, a list of float32 feature batches "
            "(batch, n_features) from the training split (e.g. flyscale.data.source.calibration_batches)"
        )
    return as_module(r.plugin.quantize(model, r.options, list(calibration)), f"{where}: quantize()")


def works_on_onnx(cfg: QuantizeConfig) -> bool:
    """Whether the configured quantizer quantizes the exported ONNX model (not the torch module)."""
    return cfg.plugin.attribute("works_on") == "onnx"


def quantize_onnx(path: Path, cfg: QuantizeConfig, calibration: Sequence[np.ndarray] | None = None) -> Path:
    """The int8 ONNX file the configured ONNX quantizer makes of the fp32 file at `path`.

    `calibration`: batches of the ONNX model's input from the training split, for a quantizer
    that calibrates."""
    r = cfg.plugin
    where = f"quantizer {cfg.name!r}"
    if r.attribute("calibrates"):
        if not calibration:
            raise ValueError(f"{where} calibrates on data: pass calibration, batches of the model's input")
        made = r.plugin.quantize(path, r.options, list(calibration))
    else:
        made = r.plugin.quantize(path, r.options)
    made = Path(made)
    if not made.is_file():
        raise TypeError(f"{where}: quantize() must return the path of the int8 ONNX file it wrote, got {made!s}")
    return made


def rebuild_quantized(model: nn.Module, cfg: QuantizeConfig, info: DatasetInfo) -> nn.Module:
    """An empty int8 module of `model`'s quantized architecture, to `load_state` saved int8 weights into
    (a torch quantizer's; an ONNX quantizer's int8 model is a file, and `model` is returned as it is).

    A calibrating quantizer is calibrated on a synthetic batch of the right shape: the real
    scales and zero points are buffers of the saved state_dict and replace these on loading.
    """
    if works_on_onnx(cfg):
        return model
    calibration = None
    if cfg.plugin.attribute("calibrates"):
        g = torch.Generator().manual_seed(0)
        calibration = [torch.randn(8, *fields.model_input_shape(info), generator=g)]
    return quantize(model, cfg, calibration)
