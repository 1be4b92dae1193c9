"""Built-in quantizers: post-training int8, dynamic (no data needed) or static (calibrated).

`dynamic_int8` (the default) and `static_int8` quantize the exported ONNX model with ONNX
Runtime's quantization tool, the path ONNX Runtime keeps supporting: the int8 model is then a
file served exactly as the fp32 one is (flyscale/export/onnx_pyfunc/), without torch.

`torch_dynamic_int8` and `torch_static_int8` are torch.ao.quantization's eager and FX
quantizers. torch deprecates torch.ao.quantization and will remove it; a model quantized that
way cannot be exported to ONNX, so its registered int8 model needs torch and flyscale to load.
They remain as named alternatives only.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.ao warns that it is deprecated, and about observer arguments it sets itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


class DynamicInt8:
    """`torch_dynamic_int8`, deprecated: torch.ao's int8 weights with activations quantized on
    the fly, for every `nn.Linear` (Conv layers stay fp32). torch.ao.quantization is deprecated
    and will be removed from torch; use `dynamic_int8` (ONNX Runtime)."""

    options_type = None

    def quantize(self, model: nn.Module, options: None) -> nn.Module:
        model = _plain_linears(copy.deepcopy(model).eval())
        with _quiet():
            return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def _plain_linears(model: nn.Module) -> nn.Module:
    """Every subclass of nn.Linear that keeps its forward (one that only changes how weights are
    initialised, as gpt's does) as a plain nn.Linear holding the same parameters. Dynamic
    quantization swaps modules by exact type, so it would leave such a layer fp32, silently."""
    for name, child in model.named_children():
        kind = type(child)
        if kind is not nn.Linear and isinstance(child, nn.Linear) and kind.forward is nn.Linear.forward:
            plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            plain.weight, plain.bias = child.weight, child.bias
            setattr(model, name, plain)
        else:
            _plain_linears(child)
    return model


class _FlattenOp(nn.Module):
    """`nn.Flatten` as the function call FX traces into (see StaticInt8: why)."""

    def __init__(self, start_dim: int, end_dim: int):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, self.start_dim, self.end_dim)


def _traceable(model: nn.Module) -> nn.Module:
    """Replace every `nn.Flatten` (no parameters, so the state_dict keys stay the same)."""
    for name, child in model.named_children():
        if type(child) is nn.Flatten:
            setattr(model, name, _FlattenOp(child.start_dim, child.end_dim))
        else:
            _traceable(child)
    return model


class StaticInt8:
    """`torch_static_int8`, deprecated (torch.ao.quantization will be removed from torch; use
    `static_int8`, ONNX Runtime's). Static post-training int8: weights AND activations int8, Conv2d and Linear (fused with a
    following ReLU), activation scales observed on calibration batches of the training split.

    The path: FX graph mode (`torch.ao.quantization.quantize_fx.prepare_fx/convert_fx`) with the
    default qconfig of the running quantized engine (`x86` here: fbgemm kernels, per-channel
    weights, histogram-observed activations). What torch 2.13 CPU offers in this venv, measured:

    - torchao is not installed (and may not be added), so its PT2E flow is out.
    - `torch.ao.quantization.quantize_pt2e` and `torch.ao.quantization.quantizer` (with
      `X86InductorQuantizer`) no longer exist in torch 2.13 (ModuleNotFoundError): PT2E moved to
      torchao. It would also have needed torch.compile to reach int8 kernels.
    - FX graph mode converts to `quantized::conv2d_relu` / `quantized::linear(_relu)` modules
      that run int8 kernels in plain eager execution, traces any symbolically traceable model,
      fuses Conv/Linear+ReLU itself, and keeps every input scale/zero point as a buffer, so a
      state_dict round-trips through `torch.load(weights_only=True)` into a module rebuilt the
      same way. Eager-mode `prepare`/`convert` also runs int8 kernels but needs QuantStub/
      DeQuantStub wrapping and hand-listed fusions, which a third-party model does not carry.
    - FX lowers `torch.flatten` as a quantized copy but wraps an `nn.Flatten` module in a
      dequantize/quantize pair; on the digits CNN at batch 1 that pair cost ~15% (363-384 us
      against 310-317 us without it, fp32 316-364 us), so `nn.Flatten` is traced as the call.

    Measured with `benchmarks/bench_quantize.py` (digits, 2 threads, AVX2 without VNNI): on the
    CNN preset 3.85x smaller and no accuracy lost, 1.16x faster at batch 64 and 1.75x at 1024,
    but 0.70x at batch 1, where quantizing each input and the per-kernel overheads outweigh the
    int8 arithmetic. Keeping the 1-channel first conv in fp32 measured no faster. `torch.ao`
    is deprecated and warns so; it stays behind this plugin interface.
    """

    options_type = None
    calibrates = True  # flyscale passes batches of training features as `calibration`

    def quantize(self, model: nn.Module, options: None, calibration: Sequence[torch.Tensor]) -> nn.Module:
        batches = list(calibration or [])
        if not batches or not all(isinstance(b, torch.Tensor) and b.is_floating_point() for b in batches):
            raise ValueError(
                "torch_static_int8 needs calibration: a non-empty list of float feature batches, shape (batch, n_features), "
                f"from the training split (got {[type(b).__name__ for b in batches] or 'none'})"
            )
        model = _traceable(copy.deepcopy(model).eval())
        qconfig = get_default_qconfig_mapping(torch.backends.quantized.engine)
        with _quiet(), torch.no_grad():
            prepared = prepare_fx(model, qconfig, example_inputs=(batches[0],))
            for batch in batches:
                prepared(batch)
            return convert_fx(prepared).eval()


class _NoPreprocessingAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


@contextlib.contextmanager
def _without_preprocessing_advice() -> Iterator[None]:
    """ONNX Runtime's quantizer advises (on the root logger, every call) to run its
    pre-processing first. That pre-processing's symbolic shape inference fails on torch's dynamo
    export of the GPT, and the exports quantize well without it (benchmarks/bench_quantize.py)."""
    advice = _NoPreprocessingAdvice()
    logging.getLogger().addFilter(advice)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(advice)


def _int8_file() -> Path:
    return Path(tempfile.mkdtemp(prefix="flyscale-int8-")) / "model_int8.onnx"


@dataclass
class OnnxDynamicOptions:
    # Which ONNX operators get int8 weights. Convolutions stay fp32 by default: ONNX Runtime's
    # ConvInteger is slower than its fp32 convolution on CPU (static_int8 quantizes them well).
    op_types: list[str] = field(default_factory=lambda: ["MatMul", "Gemm"])
    per_channel: bool = False  # one scale per output channel instead of per tensor
    # Weights in 7 bits, not 8. ONNX Runtime multiplies uint8 activations by int8 weights with
    # AVX2's VPMADDUBSW wherever the CPU lacks VNNI, and that instruction saturates the sum of two
    # products at int16, costing accuracy (docs/training.md). 7-bit weights cannot saturate, on
    # whatever CPU the model is later served on (ONNX Runtime's own advice).
    reduce_range: bool = True


class OnnxDynamicInt8:
    """ONNX Runtime's dynamic quantization: int8 weights, activations quantized on the fly per
    call. Needs no data. `model` is the fp32 ONNX file; returns the int8 one."""

    options_type = OnnxDynamicOptions
    works_on = "onnx"

    def quantize(self, model: Path, options: OnnxDynamicOptions) -> Path:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        target = _int8_file()
        with _without_preprocessing_advice():
            quantize_dynamic(
                model,
                target,
                op_types_to_quantize=options.op_types,
                per_channel=options.per_channel,
                reduce_range=options.reduce_range,
                weight_type=QuantType.QInt8,
            )
        return target


@dataclass
class OnnxStaticOptions:
    per_channel: bool = True
    # uint8 activations with int8 weights is what ONNX Runtime's x86 kernels are fastest at (U8S8).
    activations: str = "uint8"
    method: str = "minmax"  # how activation ranges are set from calibration: minmax, entropy, percentile
    reduce_range: bool = True  # 7-bit weights: see OnnxDynamicOptions

    def __post_init__(self):
        if self.activations not in ("uint8", "int8"):
            raise ValueError(f"activations must be uint8 or int8, got {self.activations!r}")
        if self.method not in ("minmax", "entropy", "percentile"):
            raise ValueError(f"method must be minmax, entropy or percentile, got {self.method!r}")


class OnnxStaticInt8:
    """ONNX Runtime's static quantization in QDQ format: weights and activations int8, activation
    ranges calibrated on rows of the training split. `model` is the fp32 ONNX file, `calibration`
    a list of batches of its inputs (numpy); returns the int8 file."""

    options_type = OnnxStaticOptions
    works_on = "onnx"
    calibrates = True

    def quantize(self, model: Path, options: OnnxStaticOptions, calibration: Sequence) -> Path:
        from onnxruntime import InferenceSession
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        batches = list(calibration or [])
        if not batches:
            raise ValueError("static_int8 needs calibration: a non-empty list of input batches from the training split")
        name = InferenceSession(str(model), providers=["CPUExecutionProvider"]).get_inputs()[0].name

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.feed = iter([{name: np.asarray(b)} for b in batches])

            def get_next(self):
                return next(self.feed, None)

        target = _int8_file()
        with _without_preprocessing_advice():
            quantize_static(
                model,
                target,
                Reader(),
                quant_format=QuantFormat.QDQ,
                per_channel=options.per_channel,
                reduce_range=options.reduce_range,
                activation_type=QuantType.QUInt8 if options.activations == "uint8" else QuantType.QInt8,
                weight_type=QuantType.QInt8,
                calibrate_method={
                    "minmax": CalibrationMethod.MinMax,
                    "entropy": CalibrationMethod.Entropy,
                    "percentile": CalibrationMethod.Percentile,
                }[options.method],
            )
        return target


dynamic_int8 = OnnxDynamicInt8()
static_int8 = OnnxStaticInt8()
torch_dynamic_int8 = DynamicInt8()  # deprecated with torch.ao.quantization
torch_static_int8 = StaticInt8()  # deprecated with torch.ao.quantization
