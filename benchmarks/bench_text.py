"""Tokenizing and packing the shipped corpus (Python's pydoc topics, about 0.46 MB, its documents
already prepared and split): flyscale's step (flyscale/data/tokenize.py: read each split's
documents, make or train the tokenizer, encode, pack into sequences, write them) against the
floor of the tokenizer alone over the same text (made or trained, then encoding every document
in one batch). Byte-level and BPE, each interleaved with its floors. Goal: ratio <= 1.5.

The byte-level tokenizer is a view of the UTF-8 bytes (well under a millisecond for the corpus),
so against it the step's time is its reading and writing; a second floor, the tokenizer and then
pyarrow writing the same packed sequences as Parquet, shows what the step adds beyond that I/O.
"""

from __future__ import annotations

import io
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flyscale.config import DataConfig, TokenizeConfig
from flyscale.data import example_combine, example_prep, source, text, tokenize
from flyscale.data.reference import Reference

GOAL = 1.5
ROUNDS = 5


def _documents():
    cfg = DataConfig(dataset="python_docs")
    info = source.info(cfg)
    part = example_prep.prepare_shard(source.examples(cfg, ""), cfg, info)
    prepared = example_combine.combine([part], cfg, info, Reference())
    splits = {"train": prepared.train, "val": prepared.val, "test": prepared.test}
    docs = {name: tokenize._documents(s, info) for name, s in splits.items()}
    return splits, info, {name: [d for batch in batches for d in batch] for name, batches in docs.items()}


def _floor(docs: dict[str, list[str]], cfg: TokenizeConfig, write: bool = False) -> None:
    """The tokenizer alone: made (or trained on the training documents) and run over every
    document; with `write`, each split's tokens then cut into sequences and written as Parquet."""
    tok = text.ByteTokenizer() if cfg.tokenizer == "byte" else text.train_bpe(docs["train"], cfg.vocab_size)
    for split in docs.values():
        ids = tok.encode_batch(split)
        if write:
            stream = np.concatenate([np.append(i, tok.eot) for i in ids]).astype("int32")
            rows = stream[: len(stream) // cfg.seq_len * cfg.seq_len]
            column = pa.FixedSizeListArray.from_arrays(pa.array(rows), cfg.seq_len)
            pq.write_table(pa.table({"tokens": column}), io.BytesIO())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    splits, info, docs = _documents()
    size = sum(len(d.encode()) for split in docs.values() for d in split) / 2**20
    print(f"Text: tokenize and pack {size:.2f} MB of prepared documents (pydoc topics), against the tokenizer alone")
    for cfg in (TokenizeConfig(), TokenizeConfig(tokenizer="bpe")):
        ours, floor, written = [], [], []
        for _ in range(ROUNDS):  # interleaved, so machine drift hits all alike
            ours.append(_timed(lambda c=cfg: tokenize.tokenize(splits, info, c)))
            floor.append(_timed(lambda c=cfg: _floor(docs, c)))
            written.append(_timed(lambda c=cfg: _floor(docs, c, write=True)))
        o, f, w = (statistics.median(t) for t in (ours, floor, written))
        verdict = "met" if o / f <= GOAL else "NOT met"
        print(
            f"  {cfg.tokenizer:<5} flyscale {o * 1000:7.1f} ms   tokenizer alone {f * 1000:7.1f} ms   "
            f"ratio {o / f:.2f} (goal <= {GOAL}: {verdict})   against the tokenizer and writing its "
            f"sequences ({w * 1000:.1f} ms): {o / w:.2f}   (medians of {ROUNDS})"
        )


if __name__ == "__main__":
    main()
