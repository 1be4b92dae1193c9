"""Text data: tokenizers that round-trip and save exactly, a BPE that trains the same anywhere,
packing that loses nothing but the counted tail, and the two built-in text datasets handing over
every document once, with its origin, and bad ones as flyscale must see them (bytes, or null)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flyscale.data import example_checks, text, tokenize
from flyscale.plugin import registry
from flyscale_plugins import python_docs
from flyscale_plugins import text as text_plugins
from flyscale_plugins.text import TextOptions

TEXT = text_plugins.text
DOCS = python_docs.python_docs


@pytest.fixture(scope="module")
def topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="module")
def bpe(topics) -> text.BpeTokenizer:
    return text.train_bpe(topics[::2], vocab_size=2048)  # the odd topics stay unseen


def _random_text(rng: np.random.Generator, n: int) -> str:
    """Code points from every plane (ASCII, accents, CJK, emoji), surrogates excluded."""
    points = rng.choice([0x7F, 0x7FF, 0xFFFF, 0x10FFFF], n)
    chars = rng.integers(1, points + 1)
    return "".join(chr(c) for c in chars if not 0xD800 <= c <= 0xDFFF)


def test_the_byte_tokenizer_round_trips_any_utf8():
    tok, rng = text.ByteTokenizer(), np.random.default_rng(0)
    docs = ["plain", "café 日本語 🙂", "", "quotes <|endoftext|> as text", *(_random_text(rng, 200) for _ in range(20))]
    for doc, ids in zip(docs, tok.encode_batch(docs)):
        assert ids.dtype == np.int32 and len(ids) == len(doc.encode("utf-8")) and ids.max(initial=0) < 256
        assert tok.decode(ids) == doc
    assert tok.decode([104, 105, 256, 0xE6, 0x97, 0xA5]) == "hi<|endoftext|>日"  # eot shown as BPE shows it
    with pytest.raises(ValueError, match=r"byte-level ids lie in \[0, 256\], got 257"):
        tok.decode([1, 257])


def test_bpe_trains_the_same_json_in_another_process(topics, bpe):
    assert text.train_bpe(topics[::2], vocab_size=2048).to_json() == bpe.to_json()
    # Another process: other hash seeds (Python's and the Rust trainer's hash maps).
    script = (
        "import hashlib, sys; from pydoc_data.topics import topics; from flyscale.data import text;"
        "docs = [topics[k] for k in sorted(topics)][::2];"
        "sys.stdout.write(hashlib.sha256(text.train_bpe(docs, 2048).to_json().encode()).hexdigest())"
    )
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert other.stdout == hashlib.sha256(bpe.to_json().encode()).hexdigest()


def test_bpe_round_trips_unseen_text_and_compresses_it(topics, bpe):
    assert bpe.name == "bpe" and bpe.vocab_size == 2048
    unseen = topics[1::2]
    ids = bpe.encode_batch(unseen)
    assert all(i.dtype == np.int32 and bpe.decode(i) == t for i, t in zip(ids, unseen))
    assert all(i.max() < bpe.vocab_size and bpe.eot not in i for i in ids)
    # Measured 3.45 UTF-8 bytes a token on the unseen half at 2,048 ids (byte-level: 1.0).
    ratio = sum(len(t.encode()) for t in unseen) / sum(len(i) for i in ids)
    assert ratio > 3.0
    rng = np.random.default_rng(1)
    odd = ["naïve 日本語 🙂\r\n\t", "", _random_text(rng, 300), "a <|endoftext|> quoted"]
    encoded = bpe.encode_batch(odd)
    assert [bpe.decode(i) for i in encoded] == odd
    assert bpe.eot not in encoded[3]  # only packing ends a document
    with pytest.raises(
        ValueError, match=r"vocab_size must be > 257 \(the byte alphabet and <\|endoftext\|>\), got 100"
    ):
        text.train_bpe(topics, vocab_size=100)


def test_from_json_restores_either_tokenizer_exactly(topics, bpe):
    for tok in (text.ByteTokenizer(), bpe):
        again = text.from_json(tok.to_json())
        assert type(again) is type(tok) and again.to_json() == tok.to_json()
        assert (again.name, again.vocab_size, again.eot) == (tok.name, tok.vocab_size, tok.eot)
        assert [a.tolist() for a in again.encode_batch(topics[:3])] == [
            a.tolist() for a in tok.encode_batch(topics[:3])
        ]
    assert json.loads(text.ByteTokenizer().to_json())["flyscale_tokenizer"] == "byte"
    for bad in ("not json", "[1]", '{"model": {"type": "WordPiece"}}'):
        with pytest.raises(ValueError, match="not a saved tokenizer"):
            text.from_json(bad)


def test_packing_lays_documents_end_to_end_and_counts_the_tail():
    docs = [np.arange(5, dtype="int32"), np.arange(10, 13, dtype="int32"), np.arange(20, 27, dtype="int32")]
    packer = text.Packer(seq_len=4, eot=99)
    windows = np.concatenate(list(packer.pack(iter(docs))))
    assert windows.dtype == np.int32 and windows.tolist() == [
        [0, 1, 2, 3],
        [4, 99, 10, 11],
        [12, 99, 20, 21],
        [22, 23, 24, 25],
    ]
    assert packer.dropped == 2  # 26 and the last eot: 18 tokens, 16 packed
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        text.pack(docs, seq_len=1, eot=99)


@pytest.mark.parametrize("seq_len", [2, 3, 7, 64])
def test_the_windows_are_the_documents_and_their_eots_truncated(seq_len):
    rng = np.random.default_rng(seq_len)
    docs = [rng.integers(0, 50, rng.choice([0, 1, 5, 300])).astype("int32") for _ in range(200)]
    packer = text.Packer(seq_len, eot=50)
    blocks = list(packer.pack(docs))
    stream = np.concatenate([np.append(d, 50) for d in docs])
    windows = np.concatenate(blocks)
    assert all(b.shape[1:] == (seq_len,) and b.dtype == np.int32 for b in blocks)
    assert windows.ravel().tolist() == stream[: len(windows) * seq_len].tolist()
    assert packer.dropped == len(stream) - windows.size and 0 <= packer.dropped < seq_len


def test_pack_yields_blocks_as_they_fill():

    def documents():
        yield from (np.zeros(1000, dtype="int32") for _ in range(100))  # 12 blocks of sequences
        raise AssertionError("pack read every document before yielding a block")

    first = next(text.pack(documents(), seq_len=2, eot=1))
    assert first.shape == (text.BLOCK_WINDOWS, 2)
    one_long = [np.zeros(3 * text.BLOCK_WINDOWS * 2 + 1, dtype="int32")]
    assert [len(b) for b in text.pack(one_long, seq_len=2, eot=1)] == [text.BLOCK_WINDOWS] * 3 + [1]


def test_unigram_entropy_is_in_bits_a_token():
    assert tokenize.unigram_entropy_bits(np.array([1, 1, 1, 1])) == pytest.approx(2.0)
    assert tokenize.unigram_entropy_bits(np.array([0, 1, 1, 2])) == pytest.approx(1.5)
    assert tokenize.unigram_entropy_bits(np.array([0, 7, 0])) == 0.0


def _examples(plugin, options) -> list[dict]:
    """Every example of every shard, as dicts."""
    shards = plugin.shards(options) if hasattr(plugin, "shards") else [""]
    return [row for shard in shards for batch in plugin.examples(options, shard) for row in batch.to_pylist()]


def test_python_docs_hands_every_topic_once_with_its_origin(topics):
    from pydoc_data.topics import topics as by_name

    rows = _examples(DOCS, None)
    assert [r["text"] for r in rows] == topics
    assert [r["_source_key"] for r in rows] == sorted(by_name)
    assert [r["_source_row"] for r in rows] == list(range(len(topics)))
    assert {r["_source_file"] for r in rows} == {"pydoc_data.topics"}
    info = DOCS.info(None)
    assert (info.input_field, info.label_column, info.num_classes, str(info.fields[0])) == (
        "text",
        "",
        0,
        "text: string",
    )
    assert DOCS.fingerprint(None) == DOCS.fingerprint(None) and sys.version.split()[0] in DOCS.fingerprint(None)


def test_both_datasets_are_registered_under_their_names():
    assert registry.datasets.get("python_docs") is DOCS and registry.datasets.get("text") is TEXT


def _by_key(rows: list[dict]) -> dict[tuple[str, str], object]:
    return {(Path(r["_source_file"]).name, r["_source_key"]): r["text"] for r in rows}


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("file", {"whole file": b"\nfirst\r\nstill first\r\n\r\n\n  \nsecond\n\nthird caf\xe9\n"}),
        ("paragraph", {"line 2": b"first\r\nstill first", "line 7": b"second", "line 9": b"third caf\xe9"}),
        ("line", {"line 2": b"first", "line 3": b"still first", "line 7": b"second", "line 9": b"third caf\xe9"}),
    ],
)
def test_text_files_are_documents_by_file_paragraph_or_line(tmp_path, document, expected):
    (tmp_path / "a.txt").write_bytes(b"\nfirst\r\nstill first\r\n\r\n\n  \nsecond\n\nthird caf\xe9\n")
    rows = _examples(TEXT, TextOptions(path=str(tmp_path), document=document))
    assert _by_key(rows) == {("a.txt", k): v for k, v in expected.items()}
    assert [r["_source_row"] for r in rows] == list(range(len(expected)))
    assert all(isinstance(r["text"], bytes) for r in rows)  # latin-1 é arrives as it was, for flyscale to judge


def test_jsonl_lines_that_hold_no_text_arrive_as_null_with_their_line(tmp_path):
    lines = ['{"text": "one"}', "not json", "", '{"other": 1}', '{"text": 7}', "[1, 2]", '{"text": "two"}', ""]
    (tmp_path / "b.jsonl").write_text("\n".join(lines))
    rows = _examples(TEXT, TextOptions(path=str(tmp_path / "b.jsonl"), batch_rows=2))
    got = {k: v for (_, k), v in _by_key(rows).items()}
    assert got == {"line 1": b"one", "line 2": None, "line 4": None, "line 5": None, "line 6": None, "line 7": b"two"}
    assert [r["_source_row"] for r in rows] == list(range(6))


def test_a_lone_surrogate_in_jsonl_reaches_flyscale_as_bytes_that_do_not_decode(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n')
    options = TextOptions(path=str(tmp_path))
    batch = next(TEXT.examples(options, TEXT.shards(options)[0]))
    checked = example_checks.check_batch(pa.Table.from_batches([batch]), TEXT.info(options), "c.jsonl")
    assert checked.reason_texts() == ["", "text: utf8 (got byte 4 is not UTF-8)"]


def _messy_file(rng: np.random.Generator, lines: int) -> bytes:
    """Lines of every kind a range boundary can fall in: text, CRLF ends, blank runs (spaces, tabs,
    a lone CR), long lines, and no newline at the end."""
    kinds = [b"", b"  ", b"\t\r", b"word", b"two words\r", b"x" * 300, "caf\u00e9 \u65e5".encode()]
    picked = rng.integers(0, len(kinds), lines)
    return b"\n".join(kinds[k] + str(i).encode() * int(k > 2) for i, k in enumerate(picked))


@pytest.mark.parametrize("document", ["line", "paragraph"])
def test_a_file_cut_into_byte_ranges_gives_each_document_once_whatever_the_cut(tmp_path, document):
    (tmp_path / "a.txt").write_bytes(_messy_file(np.random.default_rng(1), 400))
    whole = _examples(TEXT, TextOptions(path=str(tmp_path), document=document))
    assert len(whole) > 50
    for shard_bytes in (1, 7, 64, 333, 1000, 4096):
        options = TextOptions(path=str(tmp_path), document=document, shard_bytes=shard_bytes)
        shards = TEXT.shards(options)
        assert len(shards) > 1 and all("#bytes=" in s for s in shards)
        ranged = _examples(TEXT, options)
        assert [r["text"] for r in ranged] == [r["text"] for r in whole], shard_bytes
        # a document is named by the byte it starts at, and its shard by its range
        assert {r["_source_file"] for r in ranged} <= set(shards)
        assert all(r["_source_key"].startswith("byte ") for r in ranged)


def test_jsonl_over_the_cap_bom_and_bad_lines_each_come_with_their_reason(tmp_path):
    lines = [b'\xef\xbb\xbf{"text": "first, after a byte order mark"}', b'{"text": "' + b"y" * 5000 + b'"}']
    lines += [b"not json", b'{"other": 1}', b'{"text": "caf\xe9 in latin-1"}', b'{"text": "last"}']
    (tmp_path / "b.jsonl").write_bytes(b"\n".join(lines))
    options = TextOptions(path=str(tmp_path), max_document_bytes=1000)
    rows = _examples(TEXT, options)
    got = {r["_source_key"]: (r["text"], r["_source_problem"]) for r in rows}
    assert got == {
        "line 1": (b"first, after a byte order mark", None),
        "line 2": (None, "text: size (got a line of 5012 bytes, over data.options.max_document_bytes 1000: not read)"),
        "line 3": (None, "text: json (got a line that is not JSON: Expecting value)"),
        "line 4": (None, "text: missing (got no string under 'text', data.options.field)"),
        "line 5": (None, "text: utf8 (got byte 13 is not UTF-8)"),
        "line 6": (b"last", None),
    }
    # flyscale quarantines each with that reason alone, not also as a missing field
    table = pa.Table.from_batches(list(TEXT.examples(options, TEXT.shards(options)[0])))
    reasons = example_checks.check_batch(table, TEXT.info(options), "b.jsonl").reason_texts()
    assert reasons == ["", got["line 2"][1], got["line 3"][1], got["line 4"][1], got["line 5"][1], ""]


def test_a_whole_file_over_the_cap_is_not_read(tmp_path):
    (tmp_path / "big.txt").write_bytes(b"z" * 3000)
    (rows,) = [_examples(TEXT, TextOptions(path=str(tmp_path), max_document_bytes=2999))]
    assert [(r["text"], r["_source_problem"]) for r in rows] == [
        (None, "text: size (got a file of 3000 bytes, over data.options.max_document_bytes 2999: not read)")
    ]


def test_parquet_text_columns_and_a_wrong_column(tmp_path):
    pq.write_table(
        pa.table({"body": pa.array(["p0", "p1", "p2"], pa.large_string()), "n": [1, 2, 3]}), tmp_path / "d.parquet"
    )
    rows = _examples(TEXT, TextOptions(path=str(tmp_path), field="body", batch_rows=2))
    assert _by_key(rows) == {("d.parquet", "row 0"): "p0", ("d.parquet", "row 1"): "p1", ("d.parquet", "row 2"): "p2"}
    assert [r["_source_row"] for r in rows] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"has no column 'text' \(data.options.field\); it has \['body', 'n'\]"):
        _examples(TEXT, TextOptions(path=str(tmp_path)))
    with pytest.raises(ValueError, match="column 'n' holds int64, not text"):
        _examples(TEXT, TextOptions(path=str(tmp_path), field="n"))


def test_shards_are_the_files_and_cover_each_document_once(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.md").write_bytes(b"x\ny\n")
    (tmp_path / "sub" / "b.rst").write_bytes(b"z\n")
    (tmp_path / "c.jsonl").write_text('{"text": "j"}\n')
    pq.write_table(pa.table({"text": ["p"]}), tmp_path / "d.parquet")
    (tmp_path / "ignored.csv").write_text("a,b\n")
    options = TextOptions(path=str(tmp_path), document="line")
    assert [Path(s).name for s in TEXT.shards(options)] == ["a.md", "c.jsonl", "d.parquet", "b.rst"]
    rows = _examples(TEXT, options)
    origins = [(r["_source_file"], r["_source_row"]) for r in rows]
    assert len(origins) == len(set(origins)) == 5
    assert sorted(v.decode() if isinstance(v, bytes) else v for v in (r["text"] for r in rows)) == [
        "j", "p", "x", "y", "z"
    ]  # fmt: skip
    only_txt = TextOptions(path=str(tmp_path), format="txt")
    assert [Path(s).name for s in TEXT.shards(only_txt)] == ["a.md", "b.rst"]


def test_the_fingerprint_follows_the_files_and_the_reading(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one\n\ntwo\n")
    options = TextOptions(path=str(tmp_path))
    before = TEXT.fingerprint(options)
    assert TEXT.fingerprint(TextOptions(path=str(tmp_path))) == before
    assert TEXT.fingerprint(TextOptions(path=str(tmp_path), document="paragraph")) != before
    (tmp_path / "a.txt").write_bytes(b"one\n\nTWO\n")
    assert TEXT.fingerprint(options) != before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"path": ""}, "path must name a file"),
        ({"path": "x", "format": "csv"}, "format must be 'auto', 'txt', 'jsonl' or 'parquet', got 'csv'"),
        ({"path": "x", "document": "page"}, "document must be 'file', 'paragraph' or 'line', got 'page'"),
        ({"path": "x", "batch_rows": 0}, "batch_rows must be >= 1, got 0"),
    ],
)
def test_text_options_name_what_is_wrong(options, message):
    with pytest.raises(ValueError, match=message):
        TextOptions(**options)


def test_a_path_without_documents_says_so(tmp_path):
    (tmp_path / "ignored.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="holds no documents"):
        TEXT.shards(TextOptions(path=str(tmp_path)))
    with pytest.raises(ValueError, match="does not exist"):
        TEXT.shards(TextOptions(path=str(tmp_path / "missing")))


@pytest.mark.parametrize("document", ["file", "paragraph", "line"])
def test_a_byte_order_mark_is_not_part_of_the_first_document(tmp_path, document):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbffirst\n\nsecond\n")
    rows = _examples(TEXT, TextOptions(path=str(tmp_path), document=document))
    assert rows[0]["text"].startswith(b"first")


def test_a_labelled_jsonl_or_parquet_gives_each_document_its_class_or_the_reason(tmp_path):
    """`label` names where the class is; a value is matched as text (1 and "1"); a missing or
    unlisted class comes with its reason, the document as read (flyscale quarantines it)."""
    lines = [
        {"text": "one", "kind": "pos"},
        {"text": "two", "kind": 1},
        {"text": "three"},
        {"text": "four", "kind": "meh"},
        {"text": "five", "kind": 1.0},
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    options = TextOptions(path=str(tmp_path / "a.jsonl"), label="kind", classes=["neg", "pos", 1])
    info = TEXT.info(options)
    assert (info.num_classes, info.label_column, [f.name for f in info.fields]) == (3, "label", ["text", "label"])
    rows = _examples(TEXT, options)
    assert [(r["text"], r["label"], r["_source_problem"]) for r in rows] == [
        (b"one", 1, None),
        (b"two", 2, None),
        (b"three", None, "label: missing (got null under 'kind', data.options.label)"),
        (b"four", None, "label: class (got 'meh', not one of data.options.classes ['neg', 'pos', '1'])"),
        (b"five", 2, None),
    ]
    pq.write_table(pa.table({"body": ["p0", "p1"], "y": ["neg", None]}), tmp_path / "b.parquet")
    rows = _examples(
        TEXT, TextOptions(path=str(tmp_path / "b.parquet"), field="body", label="y", classes=["neg", "pos"])
    )
    assert [(r["text"], r["label"], r["_source_problem"]) for r in rows] == [
        ("p0", 0, None),
        ("p1", None, "label: missing (got null under 'y', data.options.label)"),
    ]
    with pytest.raises(ValueError, match=r"has no column 'kind' \(data.options.label\)"):
        _examples(TEXT, TextOptions(path=str(tmp_path / "b.parquet"), field="body", label="kind", classes=["a", "b"]))
    (tmp_path / "c.txt").write_text("no class here\n")
    with pytest.raises(ValueError, match="a text file holds no classes"):
        _examples(TEXT, TextOptions(path=str(tmp_path / "c.txt"), label="kind", classes=["a", "b"]))
    assert TEXT.fingerprint(options) != TEXT.fingerprint(TextOptions(path=str(tmp_path / "a.jsonl")))


def test_text_files_in_a_folder_per_class_have_their_folders_class(tmp_path):
    """label_from_folder: root/<class>/*.txt (any format); a file in a folder that is not a class
    has every document quarantined, naming the folder."""
    for folder, name, body in [("pos", "a.txt", "good\n\nfine"), ("neg", "b.txt", "bad"), ("misc", "c.txt", "meh")]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(body)
    options = TextOptions(path=str(tmp_path), document="paragraph", label_from_folder=True, classes=["neg", "pos"])
    rows = _examples(TEXT, options)
    assert sorted((r["text"], r["label"], r["_source_problem"]) for r in rows) == [
        (b"bad", 0, None),
        (b"fine", 1, None),
        (b"good", 1, None),
        (b"meh", None, "label: class (got the folder 'misc', not one of data.options.classes ['neg', 'pos'])"),
    ]
    assert TEXT.info(options).num_classes == 2
    checked = example_checks.check_batch(pa.Table.from_pylist(rows), TEXT.info(options), "folders")
    assert checked.bad.tolist() == [r["label"] is None for r in rows]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"label": "kind"}, "classes goes with data.options.label or label_from_folder"),
        ({"classes": ["a", "b"]}, "classes goes with data.options.label or label_from_folder"),
        ({"label_from_folder": True}, "classes goes with data.options.label or label_from_folder"),
        ({"label": "kind", "label_from_folder": True, "classes": ["a", "b"]}, "both say where the class is"),
        ({"label": "kind", "classes": ["a"]}, r"at least 2 distinct classes, got \['a'\]"),
        ({"label": "kind", "classes": ["a", "a"]}, "at least 2 distinct classes"),
        ({"label": "text", "classes": ["a", "b"]}, "label and data.options.field both name 'text'"),
    ],
)
def test_labelled_text_options_name_what_is_wrong(options, message):
    with pytest.raises(ValueError, match=message):
        TextOptions(path="x", **options)


def test_labelled_documents_become_one_padded_row_each_beside_their_class(tmp_path):
    """Not packed: each document's first seq_len ids, then the pad id, and its class as it was."""
    from flyscale.config import TokenizeConfig
    from flyscale.data import shards

    options = TextOptions(path="x", label="kind", classes=["a", "b"])
    info = TEXT.info(options)
    splits = {}
    for name, docs, labels in [("train", ["hi", "a longer one"], [1, 0]), ("val", ["é"], [0]), ("test", ["xyz"], [1])]:
        writer = shards.ShardWriter(name, root=str(tmp_path / name))
        writer.write(pa.table({"text": docs, "label": pa.array(labels, pa.int64())}))
        splits[name] = writer.close()
    out, out_info, _, stats = tokenize.tokenize(splits, info, TokenizeConfig(tokenizer="byte", seq_len=5))
    assert (out_info.input_field, out_info.label_column, out_info.num_classes) == ("tokens", "label", 2)
    assert out_info == tokenize.planned_info(info, TokenizeConfig(tokenizer="byte", seq_len=5))
    table = pq.read_table(shards.files(out["train"].dir.path)[0])
    assert table.column("tokens").to_pylist() == [[104, 105, 256, 256, 256], [97, 32, 108, 111, 110]]
    assert table.column("label").to_pylist() == [1, 0]
    assert pq.read_table(shards.files(out["val"].dir.path)[0]).column("tokens").to_pylist() == [
        [195, 169, 256, 256, 256]
    ]
    assert (stats.rows, stats.pad, stats.truncated, stats.sequences) == (
        True, 256, {"train": 1, "val": 0, "test": 0}, {"train": 2, "val": 1, "test": 1}
    )  # fmt: skip
    assert "one row of 5 a document, padded with id 256" in stats.lines()[1]
