"""Text through flyscale's preparation: bad documents quarantined by file and line, and the shipped
corpus prepared under real `pyflyte run` (byte-level and BPE): split by document, then tokenized
and packed, the documents' preparation cached across tokenizers. (The tokenizers, packing and the
text datasets themselves: tests/test_text.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from flyscale.config import DataConfig
from flyscale.data import example_combine, example_prep, shards, source
from flyscale.data.reference import Reference
from tests.conftest import run_pipeline

PREPARE = ("workflows/data.py", "prepare_data")


@pytest.fixture(scope="module")
def topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def test_bad_documents_are_quarantined_with_their_file_and_line(tmp_path):
    (tmp_path / "notes.txt").write_bytes(b"fine\ncaf\xe9 in latin-1\n   \nfine\nalso fine\n")
    cfg = DataConfig(dataset="text", options={"path": str(tmp_path), "document": "line"}, max_quarantine_fraction=0.9)
    info = source.info(cfg)
    parts = [
        example_prep.prepare_shard(source.examples(cfg, s), cfg, info, i, s) for i, s in enumerate(source.shards(cfg))
    ]
    prepared = example_combine.combine(parts, cfg, info, Reference())
    rows = shards.read_table(prepared.quarantined.dir.path, ["source_key", "reason"]).to_pylist()
    assert sorted((r["source_key"], r["reason"]) for r in rows) == [
        ("line 2", "text: utf8 (got byte 3 is not UTF-8)"),
        ("line 4", f"duplicate: the same values as an earlier row ({tmp_path / 'notes.txt'} row 0)"),  # line 1's
    ]
    assert prepared.report.valid_rows == 2  # the blank line is a separator, not a document


def _split(path: str) -> np.ndarray:
    return shards.read_table(path, ["tokens"]).column("tokens").combine_chunks().flatten().to_numpy()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_shipped_corpus_is_split_by_document_then_tokenized_and_packed_under_pyflyte_run(tmp_path, topics):
    corpus = '{"data": {"dataset": "python_docs"}, "tokenize": {"seq_len": 64}}'
    byte = run_pipeline(tmp_path, "--cfg", corpus, target=PREPARE)
    assert byte.returncode == 0, byte.stderr[-3000:]
    bpe = run_pipeline(tmp_path, "--cfg", corpus, "--cfg", '{"tokenize": {"tokenizer": "bpe"}}', target=PREPARE)
    assert bpe.returncode == 0, bpe.stderr[-3000:]
    assert "tokenizer   byte, 257 ids, 1.00 bytes a token" in byte.stdout
    assert "tokenizer   bpe, 2048 ids" in bpe.stdout
    # The documents were prepared once: the BPE run took them from the cache and only tokenized.
    assert "ran tokenize_text; from the cache: combine_shards, prepare_shard" in bpe.stdout
    where = dict(line.split(None, 1) for line in byte.stdout.splitlines()[-8:] if line.startswith("  ") and "/" in line)
    train, val, test = (_split(where[s].strip()) for s in ("train", "val", "test"))
    assert train.max() == 256 and len(train) % 64 == 0  # packed: ids are bytes or end-of-text
    # Split by document before packing: every document's bytes lie whole in exactly one split.
    streams = {name: bytes(t[t < 256].astype("uint8")) for name, t in (("train", train), ("val", val), ("test", test))}
    for doc in topics[::7]:
        body = doc.encode()[:200]
        assert sum(body in s for s in streams.values()) == 1, doc[:40]
    # Packed end to end: between two end-of-text tokens lies one whole document, as it was written.
    pieces = bytes(np.where(train == 256, 0, train).astype("uint8")).split(b"\0")  # the corpus holds no NUL
    whole = {t.encode() for t in topics}
    assert all(p in whole for p in pieces[1:-1]) and len(pieces) > 10
