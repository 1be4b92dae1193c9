"""Your images through real `pyflyte run`, as a user brings them: an image folder, WebDataset tar
shards and Parquet of image bytes, each prepared into the same splits (kept encoded, as a streamed
run reads them, or decoded), and trained on streamed (the folder) and in memory (the folder and the
tars); a folder with a corrupt PNG, a wrongly sized image and a duplicate quarantines exactly those
three, with their files and reasons, and trains on the rest; 16 tar shards are prepared as a map
task, one instance a shard, and a duplicate that spans two shards is found."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flyscale.data import fields
from flyscale_plugins.images import ShapesOptions, generate
from tests.conftest import run_pipeline

SIZE = 8
CLASSES = ("horizontal", "vertical", "diagonal", "checkerboard")
# Small and quick: a tiny CNN, one epoch, no gate a tiny run could fail.
TINY = {
    "model": {"name": "cnn", "options": {"channels": [8], "hidden": 16}},
    "train": {"epochs": 1, "batch_size": 32},
    "gate": [{"name": "min_metric", "options": {"threshold": 0.0}}],
}


def _images(n: int, seed: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    pixels, labels = generate(n, ShapesOptions(size=SIZE, noise=8.0, seed=seed))
    return [fields.encode_png(x) for x in pixels], labels, pixels


def _folder(root: Path, n: int = 160) -> Path:
    png, labels, _ = _images(n, seed=1)
    for i, (data, label) in enumerate(zip(png, labels, strict=True)):
        path = root / CLASSES[label] / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _tars(root: Path, shards: int, per: int = 20) -> Path:
    """`shards` WebDataset tars; with 10 or more, the first image of shard 0 is repeated as the
    last of shard 9."""
    root.mkdir(parents=True)
    png, labels, _ = _images(shards * per, seed=2)
    if shards >= 10:
        png[10 * per - 1], labels[10 * per - 1] = png[0], labels[0]
    for s in range(shards):
        with tarfile.open(root / f"shard-{s:04d}.tar", "w") as tar:
            for i in range(s * per, (s + 1) * per):
                for extension, data in (("png", png[i]), ("cls", str(labels[i]).encode())):
                    member = tarfile.TarInfo(f"{i:06d}.{extension}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return root


def _parquet(root: Path, files: int = 2, per: int = 80) -> Path:
    """Hugging Face's layout: an `image` struct of bytes and path, and a `label` column."""
    root.mkdir(parents=True)
    png, labels, _ = _images(files * per, seed=3)
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for f in range(files):
        rows = range(f * per, (f + 1) * per)
        image = pa.array([{"bytes": png[i], "path": f"img-{i}.png"} for i in rows], kind)
        pq.write_table(pa.table({"image": image, "label": pa.array(labels[list(rows)])}), root / f"train-{f}.parquet")
    return root


def _run(tmp_path: Path, mlflow_server: str, data: dict, name: str):
    cfg = json.dumps({**TINY, "data": data, "mlflow": {"model_name": name}})
    proc = run_pipeline(tmp_path, "--cfg", cfg, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_a_folder_of_images_trains_streamed(tmp_path, mlflow_server):
    """Training streams the prepared shards, whatever layout they were read from, kept encoded and
    decoded as they are read; the folder in memory and the tars in memory train below."""
    path = _folder(tmp_path / "data")
    options = {"path": str(path), "height": SIZE, "width": SIZE}
    data = {"dataset": "image_folder", "options": options, "streaming": True, "keep_encoded": True}
    out = _run(tmp_path, mlflow_server, data, "e2e-image_folder-streamed")
    assert "160 rows: 160 valid, 0 quarantined" in out, out[-2000:]
    assert "training streams its" in out
    assert "registered  e2e-" in out and "combine_shards" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout, encoded",
    [("webdataset", True), ("image_parquet", True), ("image_parquet", False)],
    ids=["webdataset-encoded", "image_parquet-encoded", "image_parquet-decoded"],
)
def test_each_layout_is_prepared_as_streaming_and_memory_read_it(tmp_path, mlflow_server, layout, encoded):
    """`pyflyte run workflows/data.py prepare_data`: each layout read into the same prepared splits,
    its images kept encoded (as a streamed run reads them) or decoded (as one in memory does). What
    training does with those splits does not depend on the layout: it runs above and below."""
    made = {"webdataset": lambda p: _tars(p, shards=8), "image_parquet": _parquet}
    path = made[layout](tmp_path / "data")
    options = {"path": str(path), "height": SIZE, "width": SIZE}
    if layout == "webdataset":
        options["num_classes"] = 4
    data = {"dataset": layout, "options": options, "streaming": encoded, "keep_encoded": encoded}
    cfg = json.dumps({**TINY, "data": data})
    proc = run_pipeline(
        tmp_path, "--cfg", cfg, env={"MLFLOW_TRACKING_URI": mlflow_server}, target=("workflows/data.py", "prepare_data")
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "160 examples: 160 valid, 0 quarantined" in out, out[-2000:]
    splits = re.search(r"splits\s+train (\d+) examples, val (\d+) examples, test (\d+) examples", out)
    assert splits and sum(int(n) for n in splits.groups()) == 160, out[-2000:]
    train = re.search(r"^\s+train\s+(\S+)$", out, re.M)
    assert train, out[-2000:]
    image = pq.read_table(train.group(1)).column("image")
    # Encoded: the PNG bytes as they came; decoded: the pixels, SIZE x SIZE x 3 of them a row.
    first = image[0].as_py()
    assert isinstance(first, bytes) and first.startswith(b"\x89PNG") if encoded else len(first) == 3 * SIZE * SIZE


@pytest.mark.timeout(300)
def test_a_corrupt_a_wrongly_sized_and_a_duplicate_image_are_quarantined_and_the_rest_trained_on(
    tmp_path, mlflow_server
):
    import mlflow
    from PIL import Image

    root = _folder(tmp_path / "photos")
    corrupt, wrong = sorted((root / "vertical").iterdir())[0], sorted((root / "diagonal").iterdir())[0]
    corrupt.write_bytes(corrupt.read_bytes()[:50])  # truncated
    Image.open(wrong).resize((SIZE + 2, SIZE)).save(wrong)  # 10 x 8
    twin = sorted((root / "horizontal").iterdir())[0]
    (root / "horizontal" / "copy.png").write_bytes(twin.read_bytes())  # a duplicate, under another name
    data = {"dataset": "image_folder", "options": {"path": str(root), "height": SIZE, "width": SIZE}}
    cfg = {**data, "max_quarantine_fraction": 0.05}
    out = _run(tmp_path, mlflow_server, cfg, "e2e-quarantine")
    assert "training reads its" in out  # the folder layout in memory (streamed: above)
    assert "161 rows: 158 valid, 3 quarantined" in out, out[-2500:]
    mlflow.set_tracking_uri(mlflow_server)
    client = mlflow.MlflowClient()
    run = client.get_run(client.get_model_version_by_alias("e2e-quarantine", "champion").run_id)
    local = client.download_artifacts(run.info.run_id, "data/quarantine", str(tmp_path / "q"))
    rows = pq.read_table(local, columns=["source_file", "source_key", "reason"]).to_pylist()
    found = {Path(r["source_file"]).relative_to(root).as_posix(): r["reason"] for r in rows}
    named = {p.relative_to(root).as_posix() for p in (corrupt, wrong)}
    assert found.keys() == {*named, "horizontal/copy.png"}
    assert found[corrupt.relative_to(root).as_posix()].startswith("image: decodable (got a PNG that does not decode")
    assert found[wrong.relative_to(root).as_posix()] == (
        f"image: shape [3, {SIZE}, {SIZE}] (got [3, {SIZE}, {SIZE + 2}]: {SIZE}x{SIZE + 2} pixels, not the "
        f"{SIZE}x{SIZE} that the dataset's height and width options declare)"
    )
    assert found["horizontal/copy.png"].startswith("duplicate: the same values as an earlier row")


@pytest.mark.timeout(300)
def test_sixteen_tar_shards_are_prepared_as_a_map_task_and_a_duplicate_across_two_is_found(tmp_path, mlflow_server):
    path = _tars(tmp_path / "tars", shards=16)
    data = {"dataset": "webdataset", "options": {"path": str(path), "num_classes": 4, "height": SIZE, "width": SIZE}}
    out = _run(tmp_path, mlflow_server, data, "e2e-sixteen")
    assert "training reads its" in out  # the tar layout in memory (streamed: above)
    assert "320 rows: 319 valid, 1 quarantined" in out, out[-2500:]
    assert "prepare_shard x16" in out  # one map-task instance a shard
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    client = mlflow.MlflowClient()
    run = client.get_run(client.get_model_version_by_alias("e2e-sixteen", "champion").run_id)
    local = client.download_artifacts(run.info.run_id, "data/quarantine", str(tmp_path / "q"))
    (row,) = pq.read_table(local, columns=["source_file", "source_key", "reason"]).to_pylist()
    assert row["source_file"].endswith("shard-0009.tar") and row["source_key"] == "000199"
    assert row["reason"].endswith(f"({path / 'shard-0000.tar'} row 0)")
