"""Tokenizers and packing: what turns documents into the token sequences a language model reads.

Three tokenizers share one small interface (`Tokenizer`): the byte-level one (ids 0-255 are
UTF-8 bytes, 256 ends a document: nothing to train, nothing unknown), a byte-level BPE trained
with Hugging Face `tokenizers` on the training split (locally: nothing is downloaded), and a
pretrained model's own (a Hugging Face checkpoint's tokenizer.json, whose ids its embedding
reads). Each saves as JSON and comes back from it exactly: the JSON is an artifact beside the
model and part of the cache key of everything after it. `Packer` lays documents end to end, each closed by the
end-of-text token, and cuts them into sequences of a fixed length.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
BLOCK_WINDOWS = 4096  # sequences `pack` yields at a time: memory holds a block, not the corpus


class Tokenizer(Protocol):
    """What tokenizing and packing need of a tokenizer, whichever kind."""

    name: str  # "byte", "bpe" or "pretrained"
    vocab_size: int
    eot: int  # the id that ends each document
    pad: int  # the id that fills a labelled document's row past its end (flyscale's own: the end-of-text id)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, and 256 for the end of a document."""

    name, vocab_size, eot, pad = "byte", 257, 256, 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's UTF-8 bytes, as int32 ids."""
        return [np.frombuffer(t.encode("utf-8"), dtype="uint8").astype("int32") for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, end-of-text shown as <|endoftext|> (as BPE shows it); bytes that a
        cut left incomplete come out as U+FFFD."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype="int64")
        if ((arr < 0) | (arr > self.eot)).any():
            bad = arr[(arr < 0) | (arr > self.eot)][0]
            raise ValueError(f"byte-level ids lie in [0, {self.eot}], got {bad}")
        pieces = np.split(arr, np.flatnonzero(arr == self.eot))
        # Every piece after the first starts with the end-of-text id that cut it.
        texts = [bytes(p[p != self.eot].astype("uint8")).decode("utf-8", errors="replace") for p in pieces]
        return EOT.join(texts)

    def to_json(self) -> str:
        """A small JSON that names this tokenizer: there is nothing else to save."""
        return json.dumps({"flyscale_tokenizer": "byte", "vocab_size": self.vocab_size, "eot": self.eot})


class BpeTokenizer:
    """A byte-level BPE (Hugging Face `tokenizers`), with <|endoftext|> as its end-of-text id."""

    name = "bpe"

    def __init__(self, tokenizer, eot: int | None = None):
        self._tok = tokenizer
        # A document that quotes "<|endoftext|>" gets its characters, never the id: only packing
        # ends documents (as the byte-level tokenizer does; the setting is not part of the JSON).
        tokenizer.encode_special_tokens = True
        self.vocab_size = tokenizer.get_vocab_size()
        if eot is None:  # flyscale's own BPE: its end of text is <|endoftext|>
            eot = tokenizer.token_to_id(EOT)
            if eot is None:
                raise ValueError(f"a BPE tokenizer for flyscale must have the special token {EOT}")
        self.eot = self.pad = eot

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, from the Rust encoder in parallel (a Python loop per text would dominate)."""
        # The fast variant skips the character offsets, which nothing here reads.
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype="int32") for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, end-of-text shown as <|endoftext|>."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        """Hugging Face's own JSON of the whole tokenizer (vocabulary, merges, pre-tokenizer)."""
        return self._tok.to_str()


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BpeTokenizer:
    """A byte-level BPE of `vocab_size` ids (the 256 bytes and <|endoftext|> among them), trained on
    `texts`. Deterministic: the same texts give the same JSON."""
    if vocab_size <= 257:
        raise ValueError(f"vocab_size must be > 257 (the byte alphabet and {EOT}), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The whole byte alphabet up front: every string encodes, and ids do not hang on which bytes
    # the corpus happens to hold. (Nothing here is random: ties between merges break by pair id.)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = BpeTokenizer(tok)
    if out.vocab_size < vocab_size:
        log.warning("BPE: the texts hold only %d ids' worth of merges, not %d", out.vocab_size, vocab_size)
    return out


class PretrainedTokenizer(BpeTokenizer):
    """A Hugging Face checkpoint's own tokenizer (any model its tokenizer.json holds: BPE,
    WordPiece, Unigram), encoded and decoded as flyscale's BPE is, with the checkpoint's
    end-of-sequence token ending each document. Encoding adds none of the special tokens a
    checkpoint's post-processor would (a beginning-of-sequence id): packing places the
    end-of-text id itself."""

    name = "pretrained"

    def __init__(self, tokenizer_json: str, eot: int, source: str, pad: int | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        super().__init__(HFTokenizer.from_str(tokenizer_json), eot)
        self._json, self.source = tokenizer_json, source
        self.pad = eot if pad is None else pad
        for what, i in (("end-of-text", eot), ("padding", self.pad)):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"the tokenizer of {source} has {self.vocab_size} ids; its {what} id {i} is not one")

    def to_json(self) -> str:
        """The checkpoint's tokenizer.json, with the end-of-text and padding ids (which
        tokenizer.json alone does not name: they are in the checkpoint's tokenizer_config.json)
        and where it came from."""
        return json.dumps(
            {
                "flyscale_tokenizer": "pretrained",
                "eot": self.eot,
                "pad": self.pad,
                "source": self.source,
                "tokenizer": self._json,
            }
        )


def load_pretrained(source: str) -> PretrainedTokenizer:
    """The tokenizer of a Hugging Face checkpoint: a local folder saved by `save_pretrained`, or a
    hub id where the machine is online (transformers resolves either). Its end-of-text id is the
    checkpoint's end-of-sequence token."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"tokenize.tokenizer {source!r} is neither 'byte', 'bpe' nor a Hugging Face checkpoint whose tokenizer "
            f"loads (a folder with tokenizer.json, or a hub id where the machine is online; `flyscale tiny-checkpoint "
            f"llama --out DIR` makes a small random one): {exc}"
        ) from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"the tokenizer of {source!r} is not a fast one (no tokenizer.json); save it with tokenizers")
    if tok.eos_token_id is None:
        raise ValueError(
            f"the tokenizer of {source!r} names no end-of-sequence token (eos_token in tokenizer_config.json), "
            "which ends each packed document"
        )
    pad = tok.pad_token_id  # what the checkpoint pads with, which its model masks out; else its end of sequence
    return PretrainedTokenizer(backend.to_str(), int(tok.eos_token_id), source, None if pad is None else int(pad))


def from_json(text: str) -> Tokenizer:
    """The tokenizer `to_json` saved."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not a saved tokenizer (not JSON: {exc})") from exc
    if isinstance(data, dict) and data.get("flyscale_tokenizer") == "byte":
        return ByteTokenizer()
    if isinstance(data, dict) and data.get("flyscale_tokenizer") == "pretrained":
        pad = data.get("pad")
        return PretrainedTokenizer(
            data["tokenizer"], int(data["eot"]), str(data.get("source", "")), None if pad is None else int(pad)
        )
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) or data["model"].get("type") != "BPE":
        raise ValueError("not a saved tokenizer: neither flyscale's byte-level one nor a Hugging Face BPE")
    from tokenizers import Tokenizer as HFTokenizer

    return BpeTokenizer(HFTokenizer.from_str(text))


class Packer:
    """Documents' tokens laid end to end, each followed by `eot`, cut into rows of `seq_len`.
    After `close`, `dropped` counts the tokens of the tail that filled no row."""

    def __init__(self, seq_len: int, eot: int):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.seq_len, self.eot = seq_len, eot
        self._tail = np.zeros(0, dtype="int32")
        self.dropped = 0

    def add(self, documents: Sequence[np.ndarray]) -> np.ndarray:
        """The complete sequences these documents fill (k, seq_len); the rest waits for the next."""
        if not len(documents):
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

    def pack(self, token_arrays: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Every sequence of these documents, in blocks of at most BLOCK_WINDOWS, then `close`."""
        pending: list[np.ndarray] = []
        size, enough = 0, BLOCK_WINDOWS * self.seq_len
        for tokens in token_arrays:
            pending.append(tokens)
            size += len(tokens) + 1
            if size >= enough:
                yield from _blocks(self.add(pending))
                pending, size = [], 0
        yield from _blocks(self.add(pending))
        self.close()


def _blocks(windows: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(windows), BLOCK_WINDOWS):
        yield windows[start : start + BLOCK_WINDOWS]


def pack(token_arrays: Iterable[np.ndarray], seq_len: int, eot: int) -> Iterator[np.ndarray]:
    """The documents as sequences (k, seq_len), in blocks (`Packer.pack`; a Packer also counts
    the tail it drops)."""
    return Packer(seq_len, eot).pack(token_arrays)
