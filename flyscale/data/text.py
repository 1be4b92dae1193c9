"""Tokenizers and packing: what turns documents into the token sequences a language model reads.

Two tokenizers share one small interface (`Tokenizer`): the byte-level one (ids 0-255 are UTF-8
bytes, 256 ends a document: nothing to train, nothing unknown) and a byte-level BPE trained with
Hugging Face `tokenizers` on the training split (locally: nothing is downloaded). Either saves
as JSON and comes back from it exactly: the JSON is an artifact beside the model and part of the
cache key of everything after it. `Packer` lays documents end to end, each closed by the
end-of-text token, and cuts them into sequences of a fixed length.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Protocol

import numpy as np

EOT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str  # "byte" or "bpe"
    vocab_size: int
    eot: int  # the id that ends each document

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, and 256 for the end of a document."""

    name, vocab_size, eot = "byte", 257, 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype="uint8").astype("int32") for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"flyscale_tokenizer": "byte", "vocab_size": 257, "eot": 256})


class BpeTokenizer:
    """A byte-level BPE (Hugging Face `tokenizers`), with <|endoftext|> as its end-of-text id."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        eot = tokenizer.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"a BPE tokenizer for flyscale must have the special token {EOT}")
        self.eot = eot

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # The Rust encoder, in parallel: a Python loop per document would dominate the step.
        return [np.asarray(e.ids, dtype="int32") for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._tok.to_str()


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BpeTokenizer:
    """A byte-level BPE of `vocab_size` ids (the 256 bytes and <|endoftext|> among them), trained on
    `texts`. Deterministic: the same texts give the same JSON."""
    if vocab_size <= 257:
        raise ValueError(f"vocab_size must be > 257 (the byte alphabet and {EOT}), got {vocab_size}")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BpeTokenizer(tok)


def from_json(text: str) -> Tokenizer:
    """The tokenizer `to_json` saved."""
    data = json.loads(text)
    if data.get("flyscale_tokenizer") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    return BpeTokenizer(HFTokenizer.from_str(text))


class Packer:
    """Documents' tokens laid end to end, each followed by `eot`, cut into rows of `seq_len`."""

    def __init__(self, seq_len: int, eot: int):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.eot = seq_len, eot
        self._tail = np.zeros(0, dtype="int32")
        self.dropped = 0

    def add(self, documents: list[np.ndarray]) -> np.ndarray:
        """The complete sequences these documents fill (k, seq_len); the rest waits for the next."""
        if not documents:
            return np.zeros((0, self.seq_len), dtype="int32")
        flat = np.concatenate(documents).astype("int32", copy=False)
        ends = np.cumsum([len(d) for d in documents])
        stream = np.concatenate([self._tail, np.insert(flat, ends, np.int32(self.eot))])
        full = len(stream) // self.seq_len * self.seq_len
        self._tail = stream[full:]
        return stream[:full].reshape(-1, self.seq_len)

    def close(self) -> np.ndarray:
        """No more documents: the tail that fills no sequence is dropped (and counted)."""
        self.dropped, self._tail = len(self._tail), np.zeros(0, dtype="int32")
        return np.zeros((0, self.seq_len), dtype="int32")


def unigram_entropy_bits(counts: np.ndarray) -> float:
    """The entropy of a token count vector, in bits a token: the loss (in bits) of a model that
    predicts each token without looking at any before it."""
    p = np.asarray(counts, dtype="float64")
    p = p[p > 0] / max(p.sum(), 1)
    return float(-(p * np.log2(p)).sum())
