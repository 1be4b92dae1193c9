"""Tokenization as a step of its own: the prepared documents of each split become token
sequences, by a tokenizer made (byte-level) or trained (BPE, on the training split only) here.

The split is by document and comes first (flyscale/data/example_combine.py), so no sequence
spans two splits. Each split's documents are encoded a row group at a time. Documents alone (a
language model's) are laid end to end, each closed by the end-of-text token, and cut into
sequences of `seq_len` tokens (the tail that does not fill one is dropped and counted).
Labelled documents (a classifier's) become one row each, beside their class: their first
`seq_len` tokens (the rest cut off, and counted), padded with the tokenizer's pad id, which a
model reads as "no token here". The tokenizer's JSON is the artifact a model carries and the
cache key of everything after it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flyscale.config import ModelConfig, TokenizeConfig
from flyscale.data import fields, shards, text
from flyscale.data.shards import Shards, ShardWriter
from flyscale.plugin.records import DatasetInfo, FieldSpec

log = logging.getLogger(__name__)

SEQUENCE_FIELD = "tokens"


@dataclass
class TokenStats:
    """How the documents were tokenized and packed, split by split."""

    tokenizer: str  # "byte", "bpe" or "pretrained"
    vocab_size: int
    seq_len: int
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # end-of-text tokens included
    sequences: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # the tail of each split that filled no sequence
    # Labelled documents: one row each, padded; how many of each split's were longer than a row, and cut.
    rows: bool = False
    truncated: dict[str, int] = field(default_factory=dict)
    pad: int = -1  # the id padding a row's end (rows only)
    bytes_per_token: float = 0.0  # of the training split's UTF-8 text
    unigram_entropy_bits: float = 0.0  # of the training split's tokens: what a model that ignores context achieves

    def lines(self) -> list[str]:
        """The summary's lines about tokenization."""
        head = (
            f"  tokenizer   {self.tokenizer}, {self.vocab_size} ids, {self.bytes_per_token:.2f} bytes a token; "
            f"unigram entropy {self.unigram_entropy_bits:.3f} bits a token (training split)"
        )
        if self.rows:
            return [
                head,
                "  tokens      "
                + ", ".join(
                    f"{s} {self.documents[s]} documents ({self.truncated[s]} cut at {self.seq_len} tokens)"
                    for s in self.tokens
                )
                + f"; one row of {self.seq_len} a document, padded with id {self.pad}",
            ]
        return [
            head,
            "  tokens      "
            + ", ".join(
                f"{s} {self.documents[s]} documents -> {self.tokens[s]} tokens ({self.dropped[s]} left over)"
                for s in self.tokens
            )
            + f"; sequences of {self.seq_len}",
        ]


def unigram_entropy_bits(counts: np.ndarray) -> float:
    """The entropy of a token count vector, in bits a token: the loss (in bits) of a model that
    predicts each token without looking at any before it."""
    p = np.asarray(counts, dtype="float64")
    p = p[p > 0] / max(p.sum(), 1)
    return float(-(p * np.log2(p)).sum())


def _documents(split: Shards, info: DatasetInfo) -> Iterator[list[str]]:
    """A split's documents, a row group at a time."""
    name = info.input_field
    for unit in shards.units(split.dir.download()):
        yield pq.ParquetFile(unit.file).read_row_group(unit.row_group, columns=[name]).column(name).to_pylist()


def make_tokenizer(train: Shards, info: DatasetInfo, cfg: TokenizeConfig) -> text.Tokenizer:
    """The byte-level tokenizer, a BPE trained on the training split's documents, or a
    checkpoint's own."""
    if cfg.tokenizer == "byte":
        return text.ByteTokenizer()
    if cfg.tokenizer == "bpe":
        docs = (d for batch in _documents(train, info) for d in batch)
        return text.train_bpe(docs, cfg.vocab_size, cfg.min_frequency)
    return text.load_pretrained(cfg.tokenizer)


def pretrained_sha256(cfg: TokenizeConfig) -> str:
    """The sha256 of the checkpoint tokenizer `tokenize.tokenizer` names, as it is now (its saved
    JSON: vocabulary, merges, end-of-text id); "" for the byte-level tokenizer and a trained BPE,
    which the config and the training split already determine. Tokenization is keyed on it, so a
    checkpoint replaced under the same folder name tokenizes again."""
    if cfg.tokenizer in ("byte", "bpe"):
        return ""
    return hashlib.sha256(text.load_pretrained(cfg.tokenizer).to_json().encode("utf-8")).hexdigest()


def labelled(info: DatasetInfo) -> bool:
    """Whether the documents have classes (a classifier's, one row each) rather than being text
    alone (a language model's, packed)."""
    return bool(info.label_column)


def sequences_info(info: DatasetInfo, tokenizer: text.Tokenizer | FieldSpec, seq_len: int) -> DatasetInfo:
    """What the tokenized splits hold: one field of `seq_len` token ids within the vocabulary, and
    for labelled documents their class as it was."""
    if isinstance(tokenizer, FieldSpec):
        tokens = tokenizer
    else:
        tokens = FieldSpec(SEQUENCE_FIELD, "int32", [seq_len], range=[0, tokenizer.vocab_size - 1])
    label = [f for f in info.fields if f.name == info.label_column] if labelled(info) else []
    return DatasetInfo(
        name=info.name,
        num_classes=info.num_classes if label else 0,
        input_shape=[seq_len],
        feature_columns=[],
        label_column=info.label_column if label else "",
        fields=[tokens, *label],
        input_field=SEQUENCE_FIELD,
        root=info.root,
    )


def check_tokenizer(info: DatasetInfo, cfg: TokenizeConfig, model_cfg: ModelConfig) -> None:
    """A model that reads a pretrained checkpoint's token ids (its plugin's `tokenizer`) must be
    given documents tokenized by that checkpoint's tokenizer: any other ids would be read as
    other words. ValueError naming both; nothing for data that is not documents."""
    documents = info.input()
    own = model_cfg.plugin.method("tokenizer")
    wanted = own(model_cfg.plugin.options) if own is not None else ""
    if documents is not None and documents.dtype == "string" and wanted and cfg.tokenizer != wanted:
        raise ValueError(
            f"model {model_cfg.name!r} reads the token ids of its checkpoint's own tokenizer, but tokenize.tokenizer is "
            f"{cfg.tokenizer!r}: set tokenize.tokenizer: {wanted}"
        )


def planned_info(info: DatasetInfo, cfg: TokenizeConfig) -> DatasetInfo:
    """What the packed splits will hold, known before any text is read: for a model checked
    before the data work. A BPE's vocabulary is the configured size (a corpus too small for
    that many merges gives fewer ids, which a model built for more still takes)."""
    documents = info.input()
    if documents is None or documents.dtype != "string":
        return info
    if cfg.tokenizer == "byte":
        vocab = text.ByteTokenizer.vocab_size
    elif cfg.tokenizer == "bpe":
        vocab = cfg.vocab_size
    else:  # a checkpoint's: its size is known without any text
        vocab = text.load_pretrained(cfg.tokenizer).vocab_size
    tokens = FieldSpec(SEQUENCE_FIELD, "int32", [cfg.seq_len], range=[0, vocab - 1])
    return sequences_info(info, tokens, cfg.seq_len)


def pack_split(
    split: Shards, name: str, info: DatasetInfo, tokenizer: text.Tokenizer, seq_len: int, stats: TokenStats
) -> tuple[Shards, np.ndarray]:
    """One split's documents as packed sequences; also the count of each token id (for entropy)."""
    out_info = sequences_info(info, tokenizer, seq_len)
    rows = fields.row_group_rows(out_info)
    writer = ShardWriter(name, rows_per_file=8 * rows, row_group_rows=rows, streamed=split.streamed)
    packer = text.Packer(seq_len, tokenizer.eot)
    counts = np.zeros(tokenizer.vocab_size, dtype="int64")
    documents = tokens = utf8 = 0
    for batch in _documents(split, info):
        encoded = tokenizer.encode_batch(batch)
        flat = np.concatenate(encoded) if encoded else np.zeros(0, dtype="int32")
        documents, tokens = documents + len(batch), tokens + len(flat) + len(batch)
        utf8 += len("".join(batch).encode("utf-8"))
        counts += np.bincount(flat, minlength=tokenizer.vocab_size)
        _write(writer, packer.add(encoded), out_info)
    _write(writer, packer.close(), out_info)
    counts[tokenizer.eot] += documents
    stats.documents[name], stats.tokens[name], stats.dropped[name] = documents, tokens, packer.dropped
    stats.sequences[name] = writer.rows
    if name == "train":
        stats.bytes_per_token = utf8 / max(1, tokens - documents)
    return writer.close(pa.schema([(SEQUENCE_FIELD, fields.arrow_type(out_info.fields[0]))])), counts


def _write(writer: ShardWriter, windows: np.ndarray, info: DatasetInfo) -> None:
    if len(windows):
        writer.write(pa.table({SEQUENCE_FIELD: fields.to_arrow(windows, info.fields[0])}))


def rows_split(
    split: Shards, name: str, info: DatasetInfo, tokenizer: text.Tokenizer, seq_len: int, stats: TokenStats
) -> tuple[Shards, np.ndarray]:
    """One split's labelled documents as one row each: the first `seq_len` tokens, padded with
    the tokenizer's pad id, beside the document's class; also the count of each token id."""
    out_info = sequences_info(info, tokenizer, seq_len)
    tokens_field, label_field = out_info.fields
    rows = fields.row_group_rows(out_info)
    writer = ShardWriter(name, rows_per_file=8 * rows, row_group_rows=rows, streamed=split.streamed)
    counts = np.zeros(tokenizer.vocab_size, dtype="int64")
    documents = tokens = truncated = utf8 = 0
    for unit in shards.units(split.dir.download()):
        group = pq.ParquetFile(unit.file).read_row_group(unit.row_group, columns=[info.input_field, info.label_column])
        batch = group.column(info.input_field).to_pylist()
        encoded = tokenizer.encode_batch(batch)
        kept = [ids[:seq_len] for ids in encoded]
        out = np.full((len(kept), seq_len), tokenizer.pad, dtype="int32")
        for i, ids in enumerate(kept):
            out[i, : len(ids)] = ids
        lengths = np.array([len(ids) for ids in encoded], dtype="int64")
        counts += np.bincount(np.concatenate(kept) if kept else np.zeros(0, "int32"), minlength=tokenizer.vocab_size)
        truncated += int((lengths > seq_len).sum())
        tokens += int(lengths.sum())
        documents += len(batch)
        utf8 += len("".join(batch).encode("utf-8"))
        labels = group.column(info.label_column).to_numpy()
        writer.write(pa.table({SEQUENCE_FIELD: fields.to_arrow(out, tokens_field), label_field.name: labels}))
    stats.documents[name], stats.tokens[name], stats.truncated[name] = documents, tokens, truncated
    stats.sequences[name], stats.dropped[name] = writer.rows, 0
    if name == "train":
        stats.bytes_per_token = utf8 / max(1, tokens)
    schema = pa.schema([(f.name, fields.arrow_type(f)) for f in out_info.fields])
    return writer.close(schema), counts


def tokenize(
    splits: dict[str, Shards], info: DatasetInfo, cfg: TokenizeConfig
) -> tuple[dict[str, Shards], DatasetInfo, str, TokenStats]:
    """Each split's documents as token sequences, packed or (labelled) one row each: (the splits,
    their info, the tokenizer's JSON, the stats)."""
    documents = info.input()
    if documents is None or documents.dtype != "string":
        raise ValueError(f"dataset {info.name!r} holds no documents (a string field) to tokenize")
    tokenizer = make_tokenizer(splits["train"], info, cfg)
    rows = labelled(info)
    stats = TokenStats(tokenizer.name, tokenizer.vocab_size, cfg.seq_len, rows=rows, pad=tokenizer.pad if rows else -1)
    out = {}
    for name, split in splits.items():
        one = rows_split if rows else pack_split
        out[name], counts = one(split, name, info, tokenizer, cfg.seq_len, stats)
        if name == "train":
            stats.unigram_entropy_bits = unigram_entropy_bits(counts)
    log.info("tokenized (%s, %d ids): %s", tokenizer.name, tokenizer.vocab_size, stats.sequences)
    return out, sequences_info(info, tokenizer, cfg.seq_len), tokenizer.to_json(), stats
