"""A language model's side of the served model: the tokenizer it was registered with, and
generation one token at a time within the request's limits.

`model` below is the served model (predictor.Served): its `run` (the ONNX session), `dtype`,
`tokens`, `serving` JSON and `limits`."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from .errors import InvalidInput
from .request_inputs import said, whole

EOT = "<|endoftext|>"


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
    """A tokenizer saved by Hugging Face `tokenizers`: a BPE flyscale trained (its end of text is
    <|endoftext|>), or a pretrained checkpoint's (its end-of-sequence id given as `eot`)."""

    def __init__(self, saved: str, eot: int | None = None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(saved)
        self.tok.encode_special_tokens = True  # as the tokenizer that made the training data
        if eot is None:
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
    if data.get("flyscale_tokenizer") == "pretrained":
        return BpeTokens(data["tokenizer"], int(data["eot"]))
    return BpeTokens(saved)


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def parameters(model: Any, params: dict) -> tuple[int, float, int]:
    """(max_new_tokens, temperature, seed) from the request's params and the model's defaults."""
    unknown = set(params) - {"max_new_tokens", "temperature", "seed"}
    if unknown:
        raise InvalidInput(
            f"unknown params {sorted(unknown)}: a language model takes max_new_tokens, temperature, seed"
        )
    max_new = params.get("max_new_tokens", model.serving["max_new_tokens"])
    temperature = params.get("temperature", model.serving["temperature"])
    seed = params.get("seed", 0)
    limit = model.limits["max_new_tokens"]
    if not whole(max_new) or not 1 <= max_new <= limit:
        raise InvalidInput(
            f"max_new_tokens must be a whole number from 1 to {limit} (serving.max_new_tokens), got {said(max_new)}"
        )
    number = isinstance(temperature, (int, float, np.number)) and not isinstance(temperature, bool)
    if not (number and math.isfinite(temperature) and temperature >= 0):
        raise InvalidInput(f"temperature must be a number >= 0 (0: the likeliest token), got {said(temperature)}")
    if not whole(seed) or not 0 <= seed < 2**63:
        raise InvalidInput(f"seed must be a whole number >= 0, got {said(seed)}")
    return int(max_new), float(temperature), int(seed)


def generate(model: Any, prompts: list[str], params: dict, started: float) -> list[str]:
    """Each prompt's continuation (new text only). Prompts of the same length in tokens run
    as one batch; an empty prompt starts from the end-of-text token. A prompt longer than the
    context is refused: the model could only read its end, and the caller should choose which.
    Past the time budget from `started` (time.monotonic()), generation stops and is refused."""
    within_limits(model, prompts)
    max_new, temperature, seed = parameters(model, params)
    deadline = started + float(model.limits["time_budget_s"])
    rng = np.random.default_rng(seed)
    window = int(model.serving["window"])
    assert model.tokens is not None
    encoded = [model.tokens.encode(p) or [model.tokens.eot] for p in prompts]
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
        ids = np.asarray([encoded[i] for i in rows], dtype=model.dtype)
        for _ in range(max_new):
            if time.monotonic() > deadline:  # between tokens: nothing runs on after the answer
                raise InvalidInput(
                    f"generation ran past this model's time budget of {model.limits['time_budget_s']:g} s "
                    f"(serving.time_budget_s) after {made:,} of {max_new * len(prompts):,} new tokens: ask for "
                    f"fewer max_new_tokens or send fewer prompts"
                )
            scores = model.run(ids[:, -window:])[:, -1, :].astype(np.float64)
            if temperature == 0:
                nxt = scores.argmax(axis=-1)
            else:
                # Shifted before dividing: a tiny temperature then gives -inf, never NaN.
                p = softmax((scores - scores.max(axis=-1, keepdims=True)) / temperature)
                nxt = np.array([rng.choice(len(row), p=row) for row in p])
            ids = np.concatenate([ids, nxt[:, None].astype(ids.dtype)], axis=1)
            made += len(rows)
        for i, row in zip(rows, ids[:, length:].tolist()):
            out[i] = model.tokens.decode(row)
    return out


def within_limits(model: Any, prompts: list[str]) -> None:
    """InvalidInput when there are more prompts than a request may send, or one is too long
    to tokenize (before the tokenizer reads it)."""
    most = model.limits["max_prompts"]
    if len(prompts) > most:
        raise InvalidInput(
            f"{len(prompts):,} prompts in one request; this model answers at most {most:,} a request "
            f"(serving.max_prompts): send them in smaller requests"
        )
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts[longest]) > model.limits["max_prompt_chars"]:
        raise InvalidInput(
            f"prompt {longest} is {len(prompts[longest]):,} characters; this model reads at most "
            f"{model.limits['max_prompt_chars']:,} (serving.max_prompt_chars): send the end of a longer text"
        )
