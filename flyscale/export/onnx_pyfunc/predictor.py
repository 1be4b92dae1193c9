"""The served model's predictor: an ONNX file run by ONNX Runtime, and what a request may send it.

Part of the model's own code (see __init__.py): nothing of flyscale is imported here.

The model owns its preprocessing: what a caller has goes in, and the model turns it into what
training fed the network (`Served.describe` lists the forms; the serving JSON holds the scale).
- numbers, a row (or an array of the declared shape) per example;
- an image model (its training data stored uint8 pixels) also takes those pixels, 0-255 as
  integers, channels first as stored, and PNG or JPEG files (bytes, or base64 strings in JSON),
  decoded as training decoded them; it divides by the scale training divided by (255), and
  refuses floats outside [0, 1], which could only be pixels left unscaled;
- a language model takes strings, at most its context length in tokens each;
- a classifier of text (trained on labelled documents) takes strings too, tokenized as training
  tokenized them (the first `seq_len` tokens, padded), as well as rows of token ids.
Anything else (NaN or infinity, an empty batch, another shape, a prompt that is not text, a bad
param) is refused with `InvalidInput`: one line that names the problem and never the input,
which MLflow's scoring server and MLServer answer as HTTP 400. So is a request past the limits
the serving JSON holds (`limits`, from the `serving` config section when it was registered):
examples or prompts in one request, characters in a prompt, `max_new_tokens`, and the time
budget of generation, checked between tokens, which stops the work, where a server's request
timeout only stops the wait. A failure of the model itself is one line too (HTTP 500), never
a stack trace.

What `predict` answers, by the `output` the serving JSON names:
- `probabilities`: a row of class probabilities per example (a softmax of the model's scores);
- `values`: the model's outputs as they are, one value per example for a scalar target;
- `text`: prompts in, their continuations out, one token at a time (params `max_new_tokens`,
  `temperature` (0: the likeliest token) and `seed`), the last `window` tokens each step.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import generation
from .errors import InvalidInput
from .generation import softmax, tokens_of
from .request_inputs import as_array, decode_image, prompts_of

OUTPUTS = ("probabilities", "values", "text")
ONNX_TYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
}
INPUT = "input"  # the one input's name in the signature (the ONNX file's input's too)
# What one request may ask, where the serving JSON names no limits (a model registered before it
# did): the `serving` section's defaults (flyscale/config/publishing.py), the same numbers.
LIMITS = {"max_rows": 1024, "max_prompts": 64, "max_prompt_chars": 65536, "max_new_tokens": 1024, "time_budget_s": 30.0}


def _shape(shape: tuple) -> str:
    return "(" + ", ".join(str(d) if isinstance(d, int) else "any" for d in shape) + ")"


class Served:
    """An ONNX model and what its answers mean, ready to predict."""

    def __init__(self, path: str, serving: dict, tokenizer_json: str = ""):
        if serving.get("output") not in OUTPUTS:
            raise ValueError(f"the serving description names output {serving.get('output')!r}; known: {OUTPUTS}")
        self.serving = serving
        if not str(path).endswith(".onnx"):
            raise ValueError(
                f"{Path(path).name}: the served model loads an ONNX file only. A torch.export program (.pt2) is "
                f"not loaded: torch.export.load may unpickle (torch.load with weights_only=False) and runs code "
                f"the file carries. Register the model again: as ONNX, or with export.fallback: torch"
            )
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        given = session.get_inputs()[0]
        self.run = lambda x: session.run(None, {given.name: x})[0]
        self.dtype = np.dtype(ONNX_TYPES.get(given.type, "float32"))
        self.shape = tuple(given.shape[1:])  # past the batch: sizes, or names of dynamic ones
        self.limits = {**LIMITS, **serving.get("limits", {})}
        if "limits" not in serving and serving["output"] == "text":  # registered before: its default still serves
            self.limits["max_new_tokens"] = max(LIMITS["max_new_tokens"], int(serving["max_new_tokens"]))
        # An image model's pixels as its training data stored them: uint8, divided by this to get
        # what the network was trained on (flyscale/data/fields.py, Reader.to_model). None: the
        # inputs are used as they come (features, token ids); models registered before this
        # was recorded have none.
        self.pixels = serving.get("input", {}).get("pixels")
        # A classifier of text: {"seq_len", "pad"}: a document sent as a string is tokenized as
        # training tokenized it (its first seq_len tokens, padded with `pad`). None: ids only.
        self.text = serving.get("input", {}).get("text")
        reads_text = serving["output"] == "text" or self.text is not None
        if reads_text and not tokenizer_json:
            raise ValueError("a model of text is served with its tokenizer; this one was registered without it")
        self.tokens = tokens_of(tokenizer_json) if reads_text else None

    @property
    def images(self) -> bool:
        """Whether PNG or JPEG files can be sent: pixels of (channels 1 or 3, height, width)."""
        return bool(self.pixels) and len(self.shape) == 3 and self.shape[0] in (1, 3)

    def describe(self) -> dict:
        """What the model takes, refuses and returns, in words (the MLmodel file's metadata:
        MLflow's signature cannot say "one of these")."""
        if self.serving["output"] == "text":
            window = int(self.serving["window"])
            return {
                "inputs": "prompts: strings (one, a list, or a one-column DataFrame)",
                "context_length": window,
                "longer_prompts": f"refused (HTTP 400 naming the limit): at most {window} tokens",
                "generation": f"each new token is predicted from the last {window} tokens",
                "params": f"max_new_tokens 1..{self.limits['max_new_tokens']}, temperature >= 0 (0: greedy), seed >= 0",
                "returns": "each prompt's continuation (the new text only)",
                "limits": self._said_limits("max_prompts", "max_prompt_chars", "max_new_tokens", "time_budget_s"),
            }
        shape = _shape(self.shape)
        forms = [
            f"numbers, shape (N, {shape[1:]}" + (f" or flat rows (N, {self._size()})" if len(self.shape) > 1 else "")
        ]
        if self.pixels:
            forms = [
                f"uint8 pixels 0-255 as integers, shape (N, {shape[1:]} channels first, as the training data "
                f"stores them",
                f"floats in [0, 1] (pixels / {self.pixels['divisor']:g}, what the network reads), the same shape",
            ]
            if self.images:
                c, h, w = self.shape
                forms.append(
                    f"PNG or JPEG files of {w}x{h} pixels ({'grayscale' if c == 1 else 'RGB'}): bytes, or base64 "
                    f"strings in JSON"
                )
        if self.text:
            forms.insert(
                0,
                f"documents: strings, each tokenized as the training data was (its first {self.text['seq_len']} tokens; "
                f"longer text is cut, as it was in training)",
            )
        return {
            "inputs": forms,
            "refused": "NaN or infinite values, an empty batch, another shape (HTTP 400, one line)",
            "limits": self._said_limits("max_rows", "max_prompt_chars") if self.text else self._said_limits("max_rows"),
            "returns": {
                "probabilities": "a row of class probabilities per example",
                "values": "the model's outputs, one value per example for a scalar target",
            }[self.serving["output"]],
        }

    def _said_limits(self, *names: str) -> dict:
        """The limits a request is held to, by the serving config field that set each."""
        return {f"serving.{n}": self.limits[n] for n in names}

    def _size(self) -> int | None:
        return math.prod(self.shape) if all(isinstance(d, int) for d in self.shape) else None

    def predict(self, model_input: Any, params: dict | None = None) -> Any:
        """The model's answer to one request, or InvalidInput naming what it cannot answer."""
        params = dict(params or {})
        output = self.serving["output"]
        if output == "text":
            return self.generate(prompts_of(model_input), params, time.monotonic())
        if params:
            raise InvalidInput(f"unknown params {sorted(params)}: this model takes none")
        x = self.inputs(model_input)
        y = self.run(x)
        if output == "probabilities":
            return softmax(y.astype(np.float64)).astype(np.float32)
        if self.serving.get("scalar") and y.ndim == 2 and y.shape[1] == 1:
            return y.reshape(len(y))
        return y

    def inputs(self, model_input: Any) -> np.ndarray:
        """What the network reads, from what was sent: checked, decoded and scaled as training did."""
        x = as_array(model_input)
        if x.ndim == 0:
            raise InvalidInput("a single value; this model takes a batch of examples (a list of them)")
        if len(x) == 0:
            raise InvalidInput("an empty batch: send at least one example")
        if len(x) > self.limits["max_rows"]:  # before any image is decoded
            raise InvalidInput(
                f"{len(x):,} examples in one request; this model answers at most {self.limits['max_rows']:,} a request "
                f"(serving.max_rows): send them in smaller requests"
            )
        if x.dtype.kind in "OUSa" and self.text:  # documents, for a classifier of text
            x = self._tokenized(x)
        elif x.dtype.kind in "OUSa":  # text or bytes: encoded images, or something unreadable
            x = self._decoded(x)
        if x.dtype.kind not in "iuf":
            what = "true/false values" if x.dtype.kind == "b" else f"values of type {x.dtype}"
            raise InvalidInput(f"the inputs are {what}; this model takes numbers")
        x = self._shaped(x)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            kind = "NaN (or null)" if np.isnan(x).any() else "infinite values"
            raise InvalidInput(
                f"{kind} in {int(bad.sum())} of {len(x)} examples (the first: example {int(bad.argmax())}); "
                f"this model takes finite numbers"
            )
        if self.pixels:
            return self._scaled(x)
        if self.dtype.kind in "iu" and x.dtype.kind == "f":
            if not (x == np.round(x)).all():
                raise InvalidInput("the inputs are fractions; this model takes token ids, whole numbers")
        return x.astype(self.dtype, copy=False)

    def _shaped(self, x: np.ndarray) -> np.ndarray:
        """`x` in the declared shape (a flat row per example is reshaped), or InvalidInput naming both."""
        size = self._size()
        if size is not None and x.ndim == 2 and x.shape[1] == size and len(self.shape) > 1:
            return x.reshape(len(x), *self.shape)  # a flat row of features into the declared shape
        want = (-1, *self.shape)
        fits = x.ndim == len(want) and all(not isinstance(d, int) or d == g for d, g in zip(want[1:], x.shape[1:]))
        if fits:
            return x
        hint = ""
        if self.images and x.ndim == 4 and x.shape[1:] == (*self.shape[1:], self.shape[0]):
            hint = " (channels last: transpose it to channels first, x.transpose(0, 3, 1, 2))"
        elif x.ndim == len(self.shape) and all(not isinstance(d, int) or d == g for d, g in zip(self.shape, x.shape)):
            hint = " (one example without the batch dimension: send a list of examples)"
        raise InvalidInput(f"inputs of shape {tuple(x.shape)}; this model takes (N, {_shape(self.shape)[1:]}{hint}")

    def _scaled(self, x: np.ndarray) -> np.ndarray:
        """Pixels as the network reads them: integers 0-255 divided by the training data's
        divisor; floats must already be in [0, 1]."""
        assert self.pixels is not None
        low, high = float(x.min()), float(x.max())
        if x.dtype.kind in "iu":
            if low < 0 or high > 255:
                raise InvalidInput(f"integer pixels must be 0-255; these run from {low:g} to {high:g}")
            return (x.astype(np.float32) / np.float32(self.pixels["divisor"])).astype(self.dtype, copy=False)
        if low < 0 or high > 1:
            raise InvalidInput(
                f"float pixels must be in [0, 1] (pixel / {self.pixels['divisor']:g}); these run from {low:g} to "
                f"{high:g}: send 0-255 pixels as integers"
            )
        return x.astype(self.dtype, copy=False)

    def _decoded(self, x: np.ndarray) -> np.ndarray:
        """Encoded images (bytes, or base64 strings) as uint8 pixels (N, C, H, W)."""
        flat = x.reshape(-1)
        if not self.images:
            raise InvalidInput(
                f"the inputs are {'text' if any(isinstance(v, str) for v in flat) else 'bytes'}; this model takes "
                f"numbers"
            )
        if x.ndim != 1:
            raise InvalidInput(f"encoded images of shape {tuple(x.shape)}: send one file per example, a flat list")
        c, h, w = self.shape
        return np.stack([decode_image(v, i, c, h, w) for i, v in enumerate(flat)])

    def _tokenized(self, x: np.ndarray) -> np.ndarray:
        """Documents as the rows of token ids training read: the first seq_len ids, padded."""
        assert self.text is not None and self.tokens is not None
        flat = x.reshape(-1)
        if x.ndim != 1 or not all(isinstance(v, str) for v in flat):
            raise InvalidInput("send documents as a flat list of strings, one per example (or rows of token ids)")
        seq_len, cap = int(self.text["seq_len"]), self.limits["max_prompt_chars"]
        out = np.full((len(flat), seq_len), int(self.text["pad"]), dtype=np.int64)
        for i, document in enumerate(flat):
            if not document:
                raise InvalidInput(f"document {i} is empty: send text")
            if len(document) > cap:
                raise InvalidInput(
                    f"document {i} has {len(document):,} characters; this model reads at most {cap:,} "
                    f"(serving.max_prompt_chars)"
                )
            ids = self.tokens.encode(document)[:seq_len]
            out[i, : len(ids)] = ids
        return out

    def generate(self, prompts: list[str], params: dict, started: float) -> list[str]:
        """Each prompt's continuation (new text only): see generation.generate."""
        return generation.generate(self, prompts, params, started)


def load(path: str, serving_path: str, tokenizer_path: str | None = None) -> Served:
    """The served model from its files (what MLflow's load_context does)."""
    tokenizer = Path(tokenizer_path).read_text() if tokenizer_path else ""
    return Served(path, json.loads(Path(serving_path).read_text()), tokenizer)
