"""Typed examples (images): each field checked, bad examples quarantined with their origin and
reason, duplicates confirmed, the splits stored as fixed-size-list columns and read back at their
declared shape; then the image preset through real `pyflyte run`."""

from __future__ import annotations

import io

import mlflow
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from flyscale.api import SOURCE_FILE, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale.config import DataConfig
from flyscale.data import example_prep, fields, shards
from flyscale.data.reference import Reference
from flyscale.data.stream_prep import DUPLICATE
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


@pytest.fixture(scope="module")
def prepared():
    """Two files of 40 PNGs: in the first a corrupt PNG, a 3x14x14 one and a label out of range;
    in the second an exact copy of an image of the first."""
    images, labels = generate(80, ShapesOptions(size=16, noise=8.0))
    png = [fields.encode_png(x) for x in images]
    png[5] = png[5][:40]  # truncated: not a PNG any more
    out = io.BytesIO()
    Image.fromarray(images[7].transpose(1, 2, 0)[:14, :14]).save(out, format="PNG")
    png[7] = out.getvalue()
    labels[9] = 7
    png[50], labels[50] = png[3], labels[3]
    batches = [_batch(png[:40], labels[:40].tolist(), "a.parquet"), _batch(png[40:], labels[40:].tolist(), "b.parquet")]
    return example_prep.prepare(batches, CFG, INFO, Reference())


def test_bad_examples_are_quarantined_with_their_origin_and_reason(prepared):
    quarantined = shards.read_table(prepared.quarantined.dir.path, [SOURCE_FILE, SOURCE_ROW, "reason"]).to_pylist()
    found = {(q[SOURCE_FILE], q[SOURCE_ROW]): q["reason"] for q in quarantined}
    assert sorted(found) == [("a.parquet", 5), ("a.parquet", 7), ("a.parquet", 9), ("b.parquet", 10)]
    assert found[("a.parquet", 5)].startswith("image: decodable (got bytes that do not decode as PNG")
    assert found[("a.parquet", 7)] == "image: shape [3, 16, 16] (got [3, 14, 14])"
    assert found[("a.parquet", 9)] == "label: in_range(0, 3) (got 7)"
    assert found[("b.parquet", 10)] == DUPLICATE
    report = prepared.report
    assert (report.total_rows, report.valid_rows, report.quarantined_rows) == (80, 76, 4)
    assert report.checks == {
        "image: decodable": 1,
        "image: shape [3, 16, 16]": 1,
        "label: in_range(0, 3)": 1,
        DUPLICATE: 1,
    }
    # The quarantine keeps each example as it came (its PNG bytes), not only its reason.
    kept = shards.read_table(prepared.quarantined.dir.path, ["image"]).column("image").to_pylist()
    assert all(isinstance(b, bytes) and b for b in kept)


def test_the_splits_hold_decoded_fields_read_back_at_their_shape(prepared):
    assert prepared.train.rows + prepared.val.rows + prepared.test.rows == 76
    table = shards.read_table(prepared.train.dir.path, ["image", "label"])
    assert table.schema.field("image").type == pa.list_(pa.uint8(), 3 * 16 * 16)
    x, y = fields.reader(INFO).read(table)
    assert x.shape == (prepared.train.rows, 3, 16, 16) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0 and y.dtype == np.int64
    # Per-channel intensity histograms are the profile drift is measured on: a handful, not a pixel each.
    assert sorted(prepared.profile.features) == ["image[c0]", "image[c1]", "image[c2]"]
    assert sum(prepared.profile.features["image[c0]"].counts) == 76 * 16 * 16


def test_examples_that_only_share_a_hash_are_all_kept():
    """Distinct examples given one hash (two in the first batch, two in later ones) are kept; the
    true copy is quarantined."""
    images, labels = generate(30, ShapesOptions(size=16))
    images[20], labels[20] = images[2], labels[2]
    raw = FieldSpec("image", "uint8", [3, 16, 16])
    info = DatasetInfo("raw", 4, [3, 16, 16], [], fields=[raw, FieldSpec("label", "int64", [])], input_field="image")
    batches = [
        pa.record_batch({"image": fields.to_arrow(images[i : i + 10], raw), "label": pa.array(labels[i : i + 10])})
        for i in range(0, 30, 10)
    ]
    colliding = example_prep.row_bytes([images[[0, 1, 15, 25]], labels[[0, 1, 15, 25]]])

    def collide(rows: np.ndarray) -> np.ndarray:
        digest = example_prep.bytes_hash(rows)
        digest[(rows[:, None, :] == colliding[None]).all(axis=2).any(axis=1)] = 42
        return digest

    out = example_prep.prepare(batches, CFG, info, Reference(), hash_rows=collide)
    quarantined = shards.read_table(out.quarantined.dir.path, [SOURCE_ROW, "reason"]).to_pylist()
    assert quarantined == [{SOURCE_ROW: 20, "reason": DUPLICATE}]
    assert out.report.valid_rows == 29


@pytest.mark.timeout(600)
def test_the_image_preset_trains_under_pyflyte_run(tmp_path, mlflow_server):
    small = '{"data": {"options": {"rows": 1500, "size": 16}}, "train": {"epochs": 4}, "mlflow": {"model_name": "shapes-e2e"}}'
    preset = str(REPO / "configs/images-cnn.yaml")
    proc = run_pipeline(tmp_path, "--cfg", preset, "--cfg", small, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "1500 rows: 1500 valid, 0 quarantined" in out
    assert "ran prepare_examples" in out and "load_data" not in out  # no table was made of the pixels
    assert "min_metric: PASSED" in out and "registered  shapes-e2e v1" in out, out[-2500:]
    # The registered model takes images at their shape, (N, 3, 16, 16), and returns class probabilities.
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/shapes-e2e@champion")
    probabilities = model.predict(np.zeros((2, 3, 16, 16), dtype="float32"))
    assert probabilities.shape == (2, 4) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-5)
