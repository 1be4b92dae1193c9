"""A registered flyscale model as MLflow serves it: an ONNX file and ONNX Runtime, nothing of flyscale.

MLflow keeps this file as the model's code (a model from code) with its artifacts beside it:
`onnx` (the model), `serving` (a small JSON that says what the model takes and returns) and, for
a language model, `tokenizer`. The PyTorch weights and the spec that rebuilds the architecture
travel too (`weights`, `spec`), for fine-tuning; serving never reads them.

This file imports only the standard library, numpy, MLflow and (when loading) onnxruntime,
`tokenizers` for a BPE language model and Pillow for an image model that is sent PNG or JPEG
files: those are the model's declared requirements, so it loads where neither flyscale, nor a
plugin package, nor torch is installed. Keep it that way: an import of flyscale here breaks every
registered model served without it. Nothing here unpickles: a version registered with a
torch.export program (`program`, .pt2) by an older flyscale is refused, since torch.export.load
may fall back to `torch.load(weights_only=False)` and runs code the file carries.

The model owns its preprocessing: what a caller has goes in, and the model turns it into what
training fed the network (`Served.describe` lists the forms; the serving JSON holds the scale).
- numbers, a row (or an array of the declared shape) per example;
- an image model (its training data stored uint8 pixels) also takes those pixels, 0-255 as
  integers, channels first as stored, and PNG or JPEG files (bytes, or base64 strings in JSON),
  decoded as training decoded them; it divides by the scale training divided by (255), and
  refuses floats outside [0, 1], which could only be pixels left unscaled;
- a language model takes strings, at most its context length in tokens each.
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

import base64
import binascii
import io
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
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

# Served by MLServer, a refusal is also its MLServerError, which its V2 endpoint answers with the
# error's status and message (any other exception is a bare 500). Looked up, never imported: the
# model's requirements do not include MLServer.
_SERVER_ERRORS: tuple = (sys.modules["mlserver.errors"].MLServerError,) if "mlserver.errors" in sys.modules else ()


class OneLine(MlflowException, *_SERVER_ERRORS):  # type: ignore[misc]
    """An answer in one line, with its error code's HTTP status and no stack trace.

    MLflow's scoring server answers an MlflowException raised in predict with its error code's
    status and its message, after rewriting the message as "Failed to predict data '<the whole
    input>'. \\nError: ..." (mlflow 3.17, pyfunc/scoring_server). The message is kept as first set,
    so the answer is this line alone; any other exception would become a generic message with a
    stack trace."""

    def __init__(self, message: str, error_code: int = INTERNAL_ERROR):
        super().__init__(message, error_code=error_code)
        self.status_code = self.get_http_status_code()  # MLServer's

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_message"):
            self._message = value


class InvalidInput(OneLine, ValueError):
    """A request the model cannot answer (HTTP 400), in one line that names the problem and not
    the input. A ValueError too, for callers in Python."""

    def __init__(self, message: str):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


class ByteTokens:
    """UTF-8 bytes as ids 0-255 and `eot` for the end of a document (flyscale's byte tokenizer)."""

    def __init__(self, eot: int):
        self.eot = eot

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        pieces, current = [], bytearray()
        for i in ids:
            if i == self.eot:
                pieces.append(current.decode("utf-8", errors="replace"))
                current = bytearray()
            else:
                current.append(i)
        return EOT.join([*pieces, current.decode("utf-8", errors="replace")])


class BpeTokens:
    """A byte-level BPE saved by Hugging Face `tokenizers`."""

    def __init__(self, saved: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(saved)
        eot = self.tok.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"the registered tokenizer has no {EOT} token")
        self.eot = eot

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def tokens_of(saved: str):
    """The tokenizer a language model was registered with (its saved JSON)."""
    data = json.loads(saved)
    if data.get("flyscale_tokenizer") == "byte":
        return ByteTokens(int(data["eot"]))
    return BpeTokens(saved)


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


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
        self.tokens = tokens_of(tokenizer_json) if serving["output"] == "text" else None
        if serving["output"] == "text" and not tokenizer_json:
            raise ValueError("a language model is served with its tokenizer; this one was registered without it")

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
        return {
            "inputs": forms,
            "refused": "NaN or infinite values, an empty batch, another shape (HTTP 400, one line)",
            "limits": self._said_limits("max_rows"),
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
            return self.generate(_prompts(model_input), params, time.monotonic())
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
        x = _array(model_input)
        if x.ndim == 0:
            raise InvalidInput("a single value; this model takes a batch of examples (a list of them)")
        if len(x) == 0:
            raise InvalidInput("an empty batch: send at least one example")
        if len(x) > self.limits["max_rows"]:  # before any image is decoded
            raise InvalidInput(
                f"{len(x):,} examples in one request; this model answers at most {self.limits['max_rows']:,} a request "
                f"(serving.max_rows): send them in smaller requests"
            )
        if x.dtype.kind in "OUSa":  # text or bytes: encoded images, or something unreadable
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
        return np.stack([_decode(v, i, c, h, w) for i, v in enumerate(flat)])

    def _generation(self, params: dict) -> tuple[int, float, int]:
        """(max_new_tokens, temperature, seed) from the request's params and the model's defaults."""
        unknown = set(params) - {"max_new_tokens", "temperature", "seed"}
        if unknown:
            raise InvalidInput(
                f"unknown params {sorted(unknown)}: a language model takes max_new_tokens, temperature, seed"
            )
        max_new = params.get("max_new_tokens", self.serving["max_new_tokens"])
        temperature = params.get("temperature", self.serving["temperature"])
        seed = params.get("seed", 0)
        limit = self.limits["max_new_tokens"]
        if not _whole(max_new) or not 1 <= max_new <= limit:
            raise InvalidInput(
                f"max_new_tokens must be a whole number from 1 to {limit} (serving.max_new_tokens), got {_said(max_new)}"
            )
        number = isinstance(temperature, (int, float, np.number)) and not isinstance(temperature, bool)
        if not (number and math.isfinite(temperature) and temperature >= 0):
            raise InvalidInput(f"temperature must be a number >= 0 (0: the likeliest token), got {_said(temperature)}")
        if not _whole(seed) or not 0 <= seed < 2**63:
            raise InvalidInput(f"seed must be a whole number >= 0, got {_said(seed)}")
        return int(max_new), float(temperature), int(seed)

    def generate(self, prompts: list[str], params: dict, started: float) -> list[str]:
        """Each prompt's continuation (new text only). Prompts of the same length in tokens run
        as one batch; an empty prompt starts from the end-of-text token. A prompt longer than the
        context is refused: the model could only read its end, and the caller should choose which.
        Past the time budget from `started` (time.monotonic()), generation stops and is refused."""
        self._within_limits(prompts)
        max_new, temperature, seed = self._generation(params)
        deadline = started + float(self.limits["time_budget_s"])
        rng = np.random.default_rng(seed)
        window = int(self.serving["window"])
        assert self.tokens is not None
        encoded = [self.tokens.encode(p) or [self.tokens.eot] for p in prompts]
        longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
        if len(encoded[longest]) > window:
            raise InvalidInput(
                f"prompt {longest} is {len(encoded[longest]):,} tokens; this model's context is {window} tokens: "
                f"send at most {window} (the end of a longer text)"
            )
        out = [""] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        made = 0
        for length, rows in by_length.items():
            ids = np.asarray([encoded[i] for i in rows], dtype=self.dtype)
            for _ in range(max_new):
                if time.monotonic() > deadline:  # between tokens: nothing runs on after the answer
                    raise InvalidInput(
                        f"generation ran past this model's time budget of {self.limits['time_budget_s']:g} s "
                        f"(serving.time_budget_s) after {made:,} of {max_new * len(prompts):,} new tokens: ask for "
                        f"fewer max_new_tokens or send fewer prompts"
                    )
                scores = self.run(ids[:, -window:])[:, -1, :].astype(np.float64)
                if temperature == 0:
                    nxt = scores.argmax(axis=-1)
                else:
                    # Shifted before dividing: a tiny temperature then gives -inf, never NaN.
                    p = softmax((scores - scores.max(axis=-1, keepdims=True)) / temperature)
                    nxt = np.array([rng.choice(len(row), p=row) for row in p])
                ids = np.concatenate([ids, nxt[:, None].astype(ids.dtype)], axis=1)
                made += len(rows)
            for i, row in zip(rows, ids[:, length:].tolist()):
                out[i] = self.tokens.decode(row)
        return out

    def _within_limits(self, prompts: list[str]) -> None:
        """InvalidInput when there are more prompts than a request may send, or one is too long
        to tokenize (before the tokenizer reads it)."""
        most = self.limits["max_prompts"]
        if len(prompts) > most:
            raise InvalidInput(
                f"{len(prompts):,} prompts in one request; this model answers at most {most:,} a request "
                f"(serving.max_prompts): send them in smaller requests"
            )
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        if len(prompts[longest]) > self.limits["max_prompt_chars"]:
            raise InvalidInput(
                f"prompt {longest} is {len(prompts[longest]):,} characters; this model reads at most "
                f"{self.limits['max_prompt_chars']:,} (serving.max_prompt_chars): send the end of a longer text"
            )


def _whole(value: Any) -> bool:
    """An int, or a float with no fraction (JSON and MLflow's param casting may make 5 into 5.0)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer()


def _said(value: Any) -> str:
    """A param's value as a message quotes it: short, whatever was sent."""
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."


def _kind(value: Any) -> str:
    """What a value is, in words, without the value."""
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return "true/false"
    if isinstance(value, (int, float, np.number)):
        return "a number"
    names: dict[type, str] = {list: "a list", dict: "an object", bytes: "bytes", str: "text"}
    return names.get(type(value), f"a {type(value).__name__}")


def _array(model_input: Any) -> np.ndarray:
    """What was sent, as one array: numbers with the dtype they came with (integers stay
    integers: they are pixels 0-255 for an image model), or an object array of bytes and strings."""
    if isinstance(model_input, dict):  # MLflow hands the signature's one named input as {name: array}
        if len(model_input) != 1:
            raise InvalidInput(f"named inputs {sorted(model_input)[:5]}: send one array of examples")
        model_input = next(iter(model_input.values()))
    columns = getattr(model_input, "columns", None)
    if columns is not None:  # a DataFrame: its columns of numbers, or one column of files or arrays
        if len(columns) == 1 and len(model_input):
            cells = list(model_input.iloc[:, 0])
            if any(isinstance(c, (list, tuple, np.ndarray, bytes, str)) for c in cells):
                return _array(cells)
        model_input = model_input.to_numpy()
    if isinstance(model_input, (bytes, str)):
        model_input = [model_input]
    if isinstance(model_input, (list, tuple)) and any(isinstance(v, (bytes, str)) for v in model_input):
        out = np.empty(len(model_input), dtype=object)  # not np.array: it would cut bytes' trailing zeros
        out[:] = list(model_input)
        return out
    x = np.asarray(model_input) if not isinstance(model_input, np.ndarray) else model_input
    if x.dtype == object:  # MLflow's parse of JSON into an object array: find the numbers' own type
        flat = x.reshape(-1)
        if any(isinstance(v, (bytes, str)) for v in flat):
            return x
        try:
            x = np.asarray(x.tolist())
        except ValueError:
            raise InvalidInput("the examples differ in shape: every one must have the same") from None
        if x.dtype == object:  # missing values (null) among numbers
            try:
                x = x.astype(np.float64)
            except (TypeError, ValueError):
                raise InvalidInput("the inputs hold values that are not numbers") from None
    return x


def _decode(value: Any, index: int, channels: int, height: int, width: int) -> np.ndarray:
    """One PNG or JPEG file (bytes, or a base64 string, a data: URL's too) as uint8 (C, H, W),
    converted as flyscale/data/fields.py decode_image converts for training; InvalidInput naming
    the example when it is not one, or not the model's size."""
    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            value = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(
                f"example {index} is a string that is not base64: send a PNG or JPEG file's bytes base64-encoded"
            ) from None
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidInput(f"example {index} is {_kind(value)} among files: send every example the same way")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(value)) as image:  # over Pillow's pixel cap: DecompressionBombError
            if image.size != (width, height):  # before decoding: a bomb is refused by its header
                raise InvalidInput(
                    f"example {index} is a {image.size[0]}x{image.size[1]} image; this model takes {width}x{height} "
                    f"(width x height)"
                )
            image.load()
            pixels = np.asarray(image.convert("L" if channels == 1 else "RGB"), dtype="uint8")
    except InvalidInput:
        raise
    except Image.DecompressionBombError:
        raise InvalidInput(f"example {index} is an image of too many pixels to decode") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        what = "not a PNG or JPEG image" if isinstance(exc, UnidentifiedImageError) else "a broken image"
        raise InvalidInput(f"example {index} is {what}") from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _prompts(model_input: Any) -> list[str]:
    """Prompts as MLflow hands them: one string, a list, or a one-column DataFrame; strings only."""
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict):
        raise InvalidInput(f"named inputs {sorted(model_input)[:5]}: send prompts as a list of strings")
    columns = getattr(model_input, "columns", None)
    if columns is not None:
        if len(columns) != 1:
            raise InvalidInput(f"a language model takes one column of prompts, got {len(columns)} columns")
        model_input = list(model_input.iloc[:, 0])
    if isinstance(model_input, np.ndarray):
        prompts = list(model_input.astype(object).reshape(-1))
    else:
        prompts = list(model_input) if isinstance(model_input, (list, tuple)) else [model_input]
    if not prompts:
        raise InvalidInput("no prompts: send at least one string")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise InvalidInput(f"prompt {i} is {_kind(p)}, not text: a language model takes strings")
    return [str(p) for p in prompts]


def load(path: str, serving_path: str, tokenizer_path: str | None = None) -> Served:
    """The served model from its files (what MLflow's load_context does)."""
    tokenizer = Path(tokenizer_path).read_text() if tokenizer_path else ""
    return Served(path, json.loads(Path(serving_path).read_text()), tokenizer)


class OnnxModel(PythonModel):
    """A flyscale model served by ONNX Runtime."""

    def load_context(self, context) -> None:
        a = context.artifacts
        self.served = load(a.get("onnx") or a["program"], a["serving"], a.get("tokenizer"))  # a program is refused

    # Without a type hint on predict, MLflow warns each time this file runs (logging, validating,
    # every load). An ndarray is a type MLflow neither validates nor converts, so the logged
    # signature and what predict receives stay as they were: {"input": array} from the named
    # tensor signature, a DataFrame of prompts from a language model's. A union would warn too
    # (MLflow 3.17 takes none here).
    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> Any:
        try:
            return self.served.predict(model_input, params)
        except OneLine:
            raise
        except Exception as exc:  # a failure of the model's own: one line to the caller, the trace to the log
            log.exception("the model failed on a request")
            raise OneLine(
                f"the model failed on this request ({type(exc).__name__}); the server's log has why"
            ) from None


mlflow.models.set_model(OnnxModel())
