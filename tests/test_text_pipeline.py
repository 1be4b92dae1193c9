"""Text: tokenizers that round-trip and save exactly, packing that loses nothing but the counted
tail, documents read from text, JSONL and Parquet files with bad ones quarantined by file and line,
and the shipped corpus prepared under real `pyflyte run` (byte-level and BPE): split by document,
then tokenized and packed, the tokenizer cached by content."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flyscale.config import DataConfig
from flyscale.data import example_combine, example_prep, shards, source, text
from flyscale.data.reference import Reference
from flyscale.plugin import registry
from tests.conftest import run_pipeline

PREPARE = ("workflows/data.py", "prepare_data")


def test_the_byte_tokenizer_round_trips_any_text():
    tok = text.ByteTokenizer()
    docs = ["plain ascii", "café, naïve, 日本語, emoji 🙂", ""]
    for doc, ids in zip(docs, tok.encode_batch(docs), strict=True):
        assert ids.dtype == np.int32 and ids.max(initial=0) < 256
        assert tok.decode(ids) == doc and len(ids) == len(doc.encode("utf-8"))
    assert text.from_json(tok.to_json()).encode_batch(docs)[1].tolist() == tok.encode_batch(docs)[1].tolist()


@pytest.fixture(scope="module")
def topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def test_bpe_trains_deterministically_offline_and_compresses(topics):
    tok = text.train_bpe(topics[:40], vocab_size=1000)
    assert tok.vocab_size == 1000 and tok.to_json() == text.train_bpe(topics[:40], vocab_size=1000).to_json()
    ids = tok.encode_batch(topics[40:45])
    assert all(tok.decode(i) == t for i, t in zip(ids, topics[40:45], strict=True))  # unseen text round-trips
    ratio = sum(len(t.encode()) for t in topics[40:45]) / sum(len(i) for i in ids)
    assert ratio > 2.5  # bytes a token, on text it was not trained on
    again = text.from_json(tok.to_json())
    assert again.eot == tok.eot and [a.tolist() for a in again.encode_batch(topics[:2])] == [
        a.tolist() for a in tok.encode_batch(topics[:2])
    ]
    with pytest.raises(ValueError, match="vocab_size must be > 257"):
        text.train_bpe(topics[:2], vocab_size=200)


def test_packing_closes_each_document_and_counts_the_tail():
    docs = [np.arange(5, dtype="int32"), np.arange(10, 13, dtype="int32"), np.arange(20, 27, dtype="int32")]
    packer = text.Packer(seq_len=4, eot=99)
    windows = np.concatenate([packer.add(docs[:2]), packer.add(docs[2:]), packer.close()])
    stream = np.concatenate([np.append(d, 99) for d in docs])  # 6 + 4 + 8 = 18 tokens
    assert windows.shape == (4, 4) and windows.ravel().tolist() == stream[:16].tolist()
    assert packer.dropped == 2
    assert text.unigram_entropy_bits(np.array([1, 1, 1, 1])) == pytest.approx(2.0)


def _documents(cfg: DataConfig) -> dict[tuple[str, int], str]:
    """Every example the dataset hands over, by (file name, row): its text or None."""
    plugin, options = cfg.plugin.plugin, cfg.plugin.options
    out = {}
    for shard in source.shards(cfg):
        for batch in plugin.examples(options, shard):
            for row in batch.to_pylist():
                value = row["text"]
                out[(row["_source_file"].rsplit("/", 1)[-1], row["_source_row"])] = (
                    value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                )
    return out


def test_documents_come_from_text_jsonl_and_parquet_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first paragraph\nstill first\n\nsecond\n\n\n")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\nnot json\n\n{"other": 1}\n{"text": "two"}\n')
    pq.write_table(pa.table({"text": ["p0", "p1"]}), tmp_path / "c.parquet")
    cfg = DataConfig(dataset="text", options={"path": str(tmp_path), "document": "paragraph"})
    docs = _documents(cfg)
    assert docs[("a.txt", 0)] == "first paragraph\nstill first" and docs[("a.txt", 1)] == "second"
    assert [docs[("b.jsonl", i)] for i in range(4)] == ["one", None, None, "two"]  # bad lines kept, as null
    assert [docs[("c.parquet", i)] for i in range(2)] == ["p0", "p1"] and len(docs) == 8
    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(pa.table({"body": ["p0"]}), other / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet has no column 'text' \(data.options.field\); it has \['body'\]"):
        _documents(DataConfig(dataset="text", options={"path": str(other)}))
    assert registry.datasets.get("text") and registry.datasets.get("python_docs")


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
        ("line 4", "duplicate: the same values as an earlier row"),
    ]
    assert prepared.report.valid_rows == 2  # the blank line is a separator, not a document


def _split(path: str) -> np.ndarray:
    return shards.read_table(path, ["tokens"]).column("tokens").combine_chunks().flatten().to_numpy()


@pytest.mark.timeout(300)
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
