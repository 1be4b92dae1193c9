"""The Protocols of the plugins that make a model, shrink it, and judge it for publication:
a model, a quantizer and a gate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from flyscale.plugin.records import DatasetInfo, GateVerdict

if TYPE_CHECKING:  # for the annotations only: configs and the plugin registry load without torch (3 s)
    from torch import nn


class ModelPlugin(Protocol):
    """Builds a fresh model: any nn.Module for DDP. The pipeline strategy splits it between
    layers, so for it return an `nn.Sequential`. A model that is not one may name its repeated
    blocks by class in a `block_types` attribute (a Hugging Face model's decoder layers): fsdp then
    shards each block as a unit, and activation checkpointing recomputes each.

    Optional, for a pretrained model (see kinds.OPTIONAL_METHODS): `pretrained(options)`, the
    Hugging Face checkpoint training starts from unless model.init_from names other weights;
    `from_huggingface(options, info, directory)`, a checkpoint's weights under the built model's
    state_dict names; `tokenizer(options)`, the checkpoint whose tokenizer makes the ids it
    reads (tokenize.tokenizer must name it); `merged(options, model)`, the trained model as it is
    kept (LoRA's adapters folded in) and its options; `portable(options)`, the options a
    registered model's spec keeps; `huggingface(options, info, model)`, the model in Hugging
    Face's format (its config.json as a dict, and its state_dict there)."""

    def build(self, options: Any, info: DatasetInfo) -> nn.Module: ...


class QuantizerPlugin(Protocol):
    """Returns a quantized copy of a trained float model (the input is left untouched).

    Optional attribute `calibrates` (default False): True when the quantizer observes data (static
    quantization). flyscale then calls `quantize(model, options, calibration)`, calibration a
    list of float32 feature batches of the training split, each (batch, n_features) flattened
    as every model receives them. Its output's architecture must depend on the model alone, not
    on the calibration values: to load saved int8 weights, flyscale rebuilds the architecture by
    calibrating on a synthetic batch, and the state_dict brings back the real scales.

    Optional attribute `works_on` (default "torch"): "onnx" for a quantizer of the exported
    model. Then `model` is the fp32 ONNX file's Path, `quantize` returns the int8 ONNX file's
    Path, and `calibration` is a list of numpy batches of the ONNX model's input. The int8 model
    is then served as the fp32 one is, by ONNX Runtime alone.
    """

    def quantize(self, model: nn.Module, options: Any) -> nn.Module: ...


class GatePlugin(Protocol):
    """Decides whether a candidate's test metrics are good enough to publish.

    Optional: `compares_champion = True`: the gate compares the candidate with the champion, so
    flyscale scores the champion's registered model on the candidate's test split first and
    `champion` holds those metrics, with `scored` 1.0 (0.0, and the champion's recorded metrics,
    when it could not be scored there). Without it `champion` holds the recorded metrics."""

    def check(
        self, metrics: Mapping[str, float], options: Any, champion: Mapping[str, float] | None
    ) -> GateVerdict: ...
