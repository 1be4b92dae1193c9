"""Typed examples (images, text): each field checked, bad examples quarantined with their origin
and reason, duplicates found within and across shards and confirmed by their values, the splits
stored as typed columns and read back at their declared shape, and the same result whatever
order or parallelism the shards ran in; then the image preset through real `pyflyte run`."""

from __future__ import annotations

import io
import json
from concurrent.futures import ProcessPoolExecutor

import mlflow
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from flyscale.api import SOURCE_FILE, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale.config import DataConfig
from flyscale.data import example_checks, example_combine, example_prep, fields, shards
from flyscale.data.prepared import DUPLICATE
from flyscale.data.reference import Reference
from flyscale.errors import DataError
from flyscale_plugins.images import ShapesOptions, generate
from tests.conftest import REPO, run_pipeline

IMAGE = FieldSpec("image", "uint8", [3, 16, 16], "png", [0, 255])
INFO = DatasetInfo(
    name="folder",
    num_classes=4,
    input_shape=[3, 16, 16],
    feature_columns=[],
    fields=[IMAGE, FieldSpec("label", "int64", [])],
    input_field="image",
)
CFG = DataConfig(dataset="shapes", max_quarantine_fraction=0.5)


def _batch(images: list[bytes], labels: list[int], file: str) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "image": pa.array(images, pa.binary()),
            "label": pa.array(labels, pa.int64()),
            SOURCE_FILE: pa.array([file] * len(labels)),
            SOURCE_ROW: pa.array(range(len(labels)), pa.int64()),
        }
    )


def _prepare(shards_: list[list[pa.RecordBatch]], info: DatasetInfo = INFO, **kw) -> example_prep.Prepared:
    parts = [example_prep.prepare_shard(b, CFG, info, i, f"s{i}", **kw) for i, b in enumerate(shards_)]
    return example_combine.combine(parts, CFG, info, Reference())


def _quarantine(prepared) -> dict[tuple[str, int], str]:
    rows = shards.read_table(prepared.quarantined.dir.path, ["source_file", "source_row", "reason"]).to_pylist()
    return {(q["source_file"], q["source_row"]): q["reason"] for q in rows}


@pytest.fixture(scope="module")
def prepared():
    """Two shards of 40 PNGs: in the first a corrupt PNG, a 3x14x14 one, a label out of range and a
    repeat of its own image 0; in the second an exact copy of an image of the first."""
    images, labels = generate(80, ShapesOptions(size=16, noise=8.0))
    png = [fields.encode_png(x) for x in images]
    png[5] = png[5][:40]  # truncated: not a PNG any more
    out = io.BytesIO()
    Image.fromarray(images[7].transpose(1, 2, 0)[:14, :14]).save(out, format="PNG")
    png[7] = out.getvalue()
    labels[9] = 7
    png[30], labels[30] = png[0], labels[0]
    png[50], labels[50] = png[3], labels[3]
    a = [_batch(png[:20], labels[:20].tolist(), "a.parquet"), _batch(png[20:40], labels[20:40].tolist(), "a.parquet")]
    # The second batch of `a` numbers its rows from 0 again; make them 20.. as a file would.
    a[1] = a[1].set_column(3, SOURCE_ROW, pa.array(range(20, 40), pa.int64()))
    return _prepare([a, [_batch(png[40:], labels[40:].tolist(), "b.parquet")]])


def test_bad_examples_are_quarantined_with_their_origin_and_reason(prepared):
    found = _quarantine(prepared)
    assert sorted(found) == [("a.parquet", 5), ("a.parquet", 7), ("a.parquet", 9), ("a.parquet", 30), ("b.parquet", 10)]
    assert found[("a.parquet", 5)].startswith("image: decodable (got bytes that are not an image PIL can read")
    assert found[("a.parquet", 7)] == (
        "image: shape [3, 16, 16] (got [3, 14, 14]: 14x14 pixels, not the 16x16 that the dataset's height and "
        "width options declare)"
    )
    assert found[("a.parquet", 9)] == "label: in_range(0, 3) (got 7)"
    assert found[("a.parquet", 30)] == f"{DUPLICATE} (a.parquet row 0)"  # within its shard, in a later batch
    assert found[("b.parquet", 10)] == f"{DUPLICATE} (a.parquet row 3)"  # across shards: names the kept twin
    report = prepared.report
    assert (report.total_rows, report.valid_rows, report.quarantined_rows) == (80, 75, 5)
    assert report.checks == {
        "image: decodable": 1,
        "image: shape [3, 16, 16]": 1,
        "label: in_range(0, 3)": 1,
        DUPLICATE: 2,
    }
    # A shard's quarantine keeps each example as it came (its PNG bytes), not only its reason.
    rows = shards.read_table(prepared.quarantined.dir.path, ["source_row", "image"]).to_pylist()
    as_came = [r["image"] for r in rows if r["source_row"] in (5, 7, 9)]
    assert len(as_came) == 3 and all(isinstance(b, bytes) and b for b in as_came)


def test_the_splits_hold_decoded_fields_read_back_at_their_shape(prepared):
    assert prepared.train.rows + prepared.val.rows + prepared.test.rows == 75
    table = shards.read_table(prepared.train.dir.path, ["image", "label", "source_file"])
    assert table.schema.field("image").type == pa.list_(pa.uint8(), 3 * 16 * 16)
    x, y = fields.reader(INFO).read(table)
    assert x.shape == (prepared.train.rows, 3, 16, 16) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0 and y.dtype == np.int64
    # A handful of histograms for drift, not one per pixel; the duplicate across shards is taken back out.
    assert sorted(prepared.profile.features) == ["image[c0]", "image[c1]", "image[c2]", "image[saturated]"]
    assert sum(prepared.profile.features["image[c0]"].counts) == 75 * 16 * 16
    assert sum(prepared.profile.labels.values()) == prepared.profile.rows == 75


def _shard_part(args):
    index, batches = args
    return example_prep.prepare_shard(batches, CFG, RAW_INFO, index, f"s{index}")


RAW = FieldSpec("image", "uint8", [3, 8, 8])
RAW_INFO = DatasetInfo("raw", 4, [3, 8, 8], [], fields=[RAW, FieldSpec("label", "int64", [])], input_field="image")


def _raw_shards(n_shards: int = 6, rows: int = 50) -> list[list[pa.RecordBatch]]:
    images, labels = generate(n_shards * rows, ShapesOptions(size=8))
    images[rows + 3], labels[rows + 3] = images[2], labels[2]  # shard 1 repeats shard 0
    if n_shards > 5:
        images[5 * rows], labels[5 * rows] = images[4 * rows + 1], labels[4 * rows + 1]  # shard 5 repeats shard 4
    return [
        [
            pa.record_batch(
                {
                    "image": fields.to_arrow(images[s * rows : (s + 1) * rows], RAW),
                    "label": pa.array(labels[s * rows : (s + 1) * rows]),
                    SOURCE_FILE: pa.array([f"shard-{s}.tar"] * rows),
                    SOURCE_ROW: pa.array(range(rows), pa.int64()),
                }
            )
        ]
        for s in range(n_shards)
    ]


@pytest.mark.timeout(120)
def test_shards_run_in_any_order_or_in_parallel_give_the_same_result():
    batches = _raw_shards()
    serial = [_shard_part((i, b)) for i, b in enumerate(batches)]
    with ProcessPoolExecutor(4) as pool:  # four at once, handed back in reverse order
        parallel = list(pool.map(_shard_part, reversed(list(enumerate(batches)))))
    one, other = (example_combine.combine(p, CFG, RAW_INFO, Reference()) for p in (serial, parallel))
    for split in ("train", "val", "test", "quarantined"):
        a, b = getattr(one, split), getattr(other, split)
        columns = ["source_file", "source_row"]
        assert shards.read_table(a.dir.path, columns).equals(shards.read_table(b.dir.path, columns)), split
    assert one.profile == other.profile and one.report == other.report
    assert _quarantine(one) == {
        ("shard-1.tar", 3): f"{DUPLICATE} (shard-0.tar row 2)",
        ("shard-5.tar", 0): f"{DUPLICATE} (shard-4.tar row 1)",
    }
    # The split depends on each example's origin only, not on how the shards were cut.
    whole = example_combine.combine(
        [example_prep.prepare_shard([b[0] for b in batches], CFG, RAW_INFO, 0, "all")], CFG, RAW_INFO, Reference()
    )
    assert shards.read_table(whole.test.dir.path, ["source_file", "source_row"]).equals(
        shards.read_table(one.test.dir.path, ["source_file", "source_row"])
    )


def test_examples_that_only_share_a_hash_are_all_kept(monkeypatch):
    """Distinct examples given one hash (within a batch, across batches, across shards) are kept;
    the true copies are quarantined."""
    batches = [[b[0].slice(0, 5), b[0].slice(5)] for b in _raw_shards(n_shards=3, rows=10)]  # two batches a shard
    # (shard, row): distinct images, all hashed alike: within a batch, across batches, across shards.
    colliding = {(0, 0), (0, 1), (0, 7), (1, 5), (2, 7)}
    real = example_checks.content_hash

    def collide(values, info):
        digest = real(values, info)
        image = values["image"].reshape(len(digest), -1)
        for s, r in colliding:
            original = batches[s][r // 5].column("image")[r % 5].values.to_numpy()
            digest[(image == original).all(axis=1)] = 42
        return digest

    monkeypatch.setattr(example_checks, "content_hash", collide)
    out = _prepare(batches, RAW_INFO)
    assert _quarantine(out) == {("shard-1.tar", 3): f"{DUPLICATE} (shard-0.tar row 2)"}
    assert out.report.valid_rows == 29


def test_images_kept_encoded_are_decoded_by_the_reader():
    images, labels = generate(30, ShapesOptions(size=16))
    png = [fields.encode_png(x) for x in images]
    out = _prepare([[_batch(png, labels.tolist(), "a.parquet")]], keep_encoded=True)
    table = shards.read_table(out.train.dir.path, ["image", "label", "source_row"])
    assert table.schema.field("image").type == pa.binary()  # the PNG bytes, as they came
    x, _ = fields.reader(INFO).read(table)
    rows = table.column("source_row").to_numpy()
    assert np.array_equal(x, images[rows].astype("float32") / 255)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` RGB pixels and holds none (its data is empty)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_a_decompression_bomb_and_a_huge_declared_size_are_quarantined_without_decoding():
    """A PNG declaring 60,000 x 60,000 pixels (over Pillow's cap: DecompressionBombError, which is
    no ValueError), and one declaring 9,000 x 8,000 (under it): both quarantined with their reason,
    the second by its header alone (its pixel data is empty, so decoding it would say so instead)."""
    images, labels = generate(20, ShapesOptions(size=16))
    png = [fields.encode_png(x) for x in images]
    png[3], png[5] = _png_header(60_000, 60_000), _png_header(9_000, 8_000)
    found = _quarantine(_prepare([[_batch(png, labels.tolist(), "a.parquet")]]))
    assert sorted(found) == [("a.parquet", 3), ("a.parquet", 5)]
    assert found[("a.parquet", 3)].startswith("image: decodable (got an image of too many pixels to decode"), found
    assert found[("a.parquet", 5)] == (
        "image: shape [3, 16, 16] (got [3, 8000, 9000]: 8000x9000 pixels, not the 16x16 that the dataset's height "
        "and width options declare)"
    )


def test_documents_that_are_not_utf8_or_are_empty_are_quarantined():
    text = FieldSpec("text", "string", [])
    info = DatasetInfo("docs", 0, [], [], label_column="", fields=[text], input_field="text")
    docs = [b"one document", b"caf\xc3\xa9 ok", b"bad \xff byte", b"  \n ", None, b"one document"]
    docs += [f"document {i}".encode() for i in range(10)]
    batch = pa.record_batch({"text": pa.array(docs, pa.binary()), SOURCE_FILE: pa.array(["d.txt"] * len(docs))})
    out = _prepare([[batch]], info)
    assert _quarantine(out) == {
        ("d.txt", 2): "text: utf8 (got byte 4 is not UTF-8)",
        ("d.txt", 3): "text: not_empty (got 4 blank characters)",
        ("d.txt", 4): "text: missing (got null)",
        ("d.txt", 5): f"{DUPLICATE} (d.txt row 0)",  # within the batch: names the example it repeats
    }
    kept = shards.read_table(out.train.dir.path, ["text"]).column("text").to_pylist()
    kept += shards.read_table(out.val.dir.path, ["text"]).column("text").to_pylist()
    kept += shards.read_table(out.test.dir.path, ["text"]).column("text").to_pylist()
    assert sorted(kept) == sorted(["café ok", "one document", *(f"document {i}" for i in range(10))])
    assert sum(out.profile.features["text[length]"].counts) == 12


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_the_image_preset_trains_under_pyflyte_run(tmp_path, mlflow_server):
    small = '{"data": {"options": {"rows": 1500, "size": 16, "chunk_rows": 500}}, "train": {"epochs": 4}, "mlflow": {"model_name": "shapes-e2e"}}'
    preset = str(REPO / "configs/images-cnn.yaml")
    proc = run_pipeline(tmp_path, "--cfg", preset, "--cfg", small, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "1500 rows: 1500 valid, 0 quarantined" in out
    assert "combine_shards" in out and "load_data" not in out  # no table was made of the pixels
    assert "min_metric: PASSED" in out and "registered  shapes-e2e v1" in out, out[-2500:]
    # The registered model takes images at their shape, (N, 3, 16, 16), and returns class probabilities.
    mlflow.set_tracking_uri(mlflow_server)
    client = mlflow.MlflowClient()
    run = client.get_run(client.get_model_version_by_alias("shapes-e2e", "champion").run_id)
    # The runs table's Dataset column: the data, its fingerprint and each split it was used as.
    inputs = run.inputs.dataset_inputs
    contexts = sorted(next(t.value for t in i.tags if t.key == "mlflow.data.context") for i in inputs)
    assert contexts == ["testing", "training", "validation"]
    assert {i.dataset.name for i in inputs} == {"shapes"}
    fingerprint = run.data.tags["flyscale.data_fingerprint"][:12]
    assert {i.dataset.digest for i in inputs} == {f"{fingerprint}-{s}" for s in ("train", "val", "test")}
    schema = json.loads(inputs[0].dataset.schema)["mlflow_colspec"]
    assert schema[0] == {"name": "image", "type": "tensor", "tensor-spec": {"dtype": "uint8", "shape": [-1, 3, 16, 16]}}
    model = mlflow.pyfunc.load_model("models:/shapes-e2e@champion")
    probabilities = model.predict(np.zeros((2, 3, 16, 16), dtype="float32"))
    assert probabilities.shape == (2, 4) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-5)


def test_images_drift_per_channel_and_in_saturation_against_the_reference():
    images, labels = generate(300, ShapesOptions(size=8))
    info = RAW_INFO

    def prepared(x: np.ndarray, cfg: DataConfig = CFG, reference: Reference | None = None):
        batch = pa.record_batch({"image": fields.to_arrow(x, RAW), "label": pa.array(labels)})
        part = example_prep.prepare_shard([batch], cfg, info)
        return example_combine.combine([part], cfg, info, reference or Reference())

    before = prepared(images)
    same = prepared(images, reference=Reference(source="v1", profile=before.profile))
    assert sorted(same.report.drift) == ["image[c0]", "image[c1]", "image[c2]", "image[saturated]", "label"]
    assert max(same.report.drift.values()) < 1e-6
    # A camera that over-exposes: every channel shifts, and many more pixels are blown out.
    brighter = np.clip(images.astype("int64") * 3, 0, 255).astype("uint8")
    strict = DataConfig(dataset="shapes", max_drift_psi=0.25)
    with pytest.raises(DataError, match=r"max_drift_psi=0.25 for 4 of 5 columns \(image\[saturated\] "):
        prepared(brighter, strict, Reference(source="v1", profile=before.profile))


def test_a_shard_that_keeps_nothing_does_not_stop_the_others():
    """Every example of the first shard quarantined (a file of one huge line, cut into ranges, gives
    such shards): the combine still looks the next shard's examples up, and keeps them."""
    images, labels = generate(10, ShapesOptions(size=16))
    good = [fields.encode_png(x) for x in images]
    prepared = _prepare([[_batch([b"not an image"] * 3, [0, 1, 0], "bad")], [_batch(good, labels.tolist(), "good")]])
    assert sorted(_quarantine(prepared)) == [("bad", 0), ("bad", 1), ("bad", 2)]
    assert prepared.report.valid_rows == 10
