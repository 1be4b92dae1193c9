"""Built-in quantizers: post-training, no calibration data needed."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


class DynamicInt8:
    """int8 weights with activations quantized on the fly, for every `nn.Linear`.

    `torch.ao.quantization.quantize_dynamic` is deprecated in favour of torchao, but torchao's
    int8 is reported slower on CPU; it stays behind this plugin interface so a second quantizer
    can replace it without touching the pipeline. Conv layers stay fp32 (dynamic quantization
    covers Linear/RNN layers only).
    """

    options_type = None

    def quantize(self, model: nn.Module, options: None) -> nn.Module:
        model = copy.deepcopy(model).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


dynamic_int8 = DynamicInt8()
