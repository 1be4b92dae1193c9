"""A registered flyscale model as MLflow serves it: an ONNX file and ONNX Runtime, nothing of flyscale.

MLflow keeps this file as the model's code (a model from code) with its artifacts beside it:
`onnx` (the model), `serving` (a small JSON that says what the model takes and returns) and, for
a language model, `tokenizer`. The PyTorch weights and the spec that rebuilds the architecture
travel too (`weights`, `spec`), for fine-tuning; serving never reads them.

This file imports only the standard library, numpy, MLflow and (when loading) onnxruntime, and
`tokenizers` for a BPE language model: those are the model's declared requirements, so it loads
where neither flyscale, nor a plugin package, nor torch is installed. A model ONNX cannot take
(an operator it lacks) comes as a torch.export program instead (`program`, a .pt2 file): then
torch is imported and declared, but still no flyscale and no plugin. Keep it that way: an import
of flyscale here breaks every registered model served without it.

What `predict` answers, by the `output` the serving JSON names:
- `probabilities`: a row of class probabilities per example (a softmax of the model's scores);
- `values`: the model's outputs as they are, one value per example for a scalar target;
- `text`: prompts in, their continuations out, one token at a time (params `max_new_tokens`,
  `temperature` (0: the likeliest token) and `seed`), the last `window` tokens each step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel

EOT = "<|endoftext|>"
OUTPUTS = ("probabilities", "values", "text")
ONNX_TYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
}


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


class Served:
    """An ONNX model and what its answers mean, ready to predict."""

    def __init__(self, path: str, serving: dict, tokenizer_json: str = ""):
        if serving.get("output") not in OUTPUTS:
            raise ValueError(f"the serving description names output {serving.get('output')!r}; known: {OUTPUTS}")
        self.serving = serving
        if str(path).endswith(".pt2"):  # a torch.export program: the fallback for what ONNX cannot take
            import torch

            module = torch.export.load(str(path)).module()
            self.run = lambda x: module(torch.from_numpy(x)).detach().numpy()
            self.dtype = np.dtype(serving["input"]["dtype"])
            self.shape = tuple(serving["input"]["shape"])
        else:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            given = session.get_inputs()[0]
            self.run = lambda x: session.run(None, {given.name: x})[0]
            self.dtype = np.dtype(ONNX_TYPES.get(given.type, "float32"))
            self.shape = tuple(given.shape[1:])  # past the batch: sizes, or names of dynamic ones
        self.tokens = tokens_of(tokenizer_json) if serving["output"] == "text" else None
        if serving["output"] == "text" and not tokenizer_json:
            raise ValueError("a language model is served with its tokenizer; this one was registered without it")

    def predict(self, model_input: Any, params: dict | None = None) -> Any:
        params = dict(params or {})
        output = self.serving["output"]
        if output == "text":
            return self.generate(_prompts(model_input), params)
        if params:
            raise ValueError(f"unknown params {sorted(params)}: this model takes none")
        x = np.asarray(model_input, dtype=self.dtype)
        if x.shape[1:] != self.shape and all(isinstance(d, int) for d in self.shape):
            x = x.reshape(len(x), *self.shape)  # a flat row of features into the declared shape
        y = self.run(x)
        if output == "probabilities":
            return softmax(y.astype(np.float64)).astype(np.float32)
        if self.serving.get("scalar") and y.ndim == 2 and y.shape[1] == 1:
            return y.reshape(len(y))
        return y

    def generate(self, prompts: list[str], params: dict) -> list[str]:
        """Each prompt's continuation (new text only). Prompts of the same length in tokens run
        as one batch; an empty prompt starts from the end-of-text token."""
        unknown = set(params) - {"max_new_tokens", "temperature", "seed"}
        if unknown:
            raise ValueError(
                f"unknown params {sorted(unknown)}: a language model takes max_new_tokens, temperature, seed"
            )
        max_new = int(params.get("max_new_tokens", self.serving["max_new_tokens"]))
        temperature = float(params.get("temperature", self.serving["temperature"]))
        if max_new < 0 or temperature < 0:
            raise ValueError("max_new_tokens and temperature must be >= 0")
        rng = np.random.default_rng(int(params.get("seed", 0)))
        window = int(self.serving["window"])
        assert self.tokens is not None
        encoded = [self.tokens.encode(p) or [self.tokens.eot] for p in prompts]
        out = [""] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        for length, rows in by_length.items():
            ids = np.asarray([encoded[i] for i in rows], dtype=self.dtype)
            for _ in range(max_new):
                scores = self.run(ids[:, -window:])[:, -1, :].astype(np.float64)
                if temperature == 0:
                    nxt = scores.argmax(axis=-1)
                else:
                    p = softmax(scores / temperature)
                    nxt = np.array([rng.choice(len(row), p=row) for row in p])
                ids = np.concatenate([ids, nxt[:, None].astype(ids.dtype)], axis=1)
            for i, row in zip(rows, ids[:, length:].tolist()):
                out[i] = self.tokens.decode(row)
        return out


def _prompts(model_input: Any) -> list[str]:
    """Prompts as MLflow hands them: one string, a list, or a one-column DataFrame."""
    if isinstance(model_input, str):
        return [model_input]
    columns = getattr(model_input, "columns", None)
    if columns is not None:
        if len(columns) != 1:
            raise ValueError(f"a language model takes one column of prompts, got {list(columns)}")
        return [str(p) for p in model_input.iloc[:, 0]]
    return [str(p) for p in model_input]


def load(path: str, serving_path: str, tokenizer_path: str | None = None) -> Served:
    """The served model from its files (what MLflow's load_context does)."""
    tokenizer = Path(tokenizer_path).read_text() if tokenizer_path else ""
    return Served(path, json.loads(Path(serving_path).read_text()), tokenizer)


class OnnxModel(PythonModel):
    """A flyscale model served by ONNX Runtime."""

    def load_context(self, context) -> None:
        a = context.artifacts
        self.served = load(a.get("onnx") or a["program"], a["serving"], a.get("tokenizer"))

    # Without a type hint on predict, MLflow warns each time this file runs (logging, validating,
    # every load). An ndarray is what a tensor signature hands in (a language model's prompts come
    # as a DataFrame): a type MLflow neither validates nor converts, so the logged signature and
    # what predict receives stay as they were. A union would warn too (MLflow 3.17 takes none here).
    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> Any:
        return self.served.predict(model_input, params)


mlflow.models.set_model(OnnxModel())
