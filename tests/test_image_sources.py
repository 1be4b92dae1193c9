"""The `image_folder`, `webdataset` and `image_parquet` datasets on real files: PNGs and JPEGs
written with PIL, tars written with `tarfile`, Parquet as Hugging Face exports it, locally and
on a real S3 server (moto). Each is used through the registry and config, as a run uses it."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from flyscale.config import DataConfig
from flyscale.data import example_combine, example_prep, shards, source
from flyscale.data.fields import decode_image
from flyscale.data.reference import Reference
from flyscale.plugin import registry

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    return tmp_path.resolve()  # origins name local files by their real path (macOS's /tmp is a link)


def _image(shade: int, kind: str = "PNG", size: tuple[int, int] = (4, 4)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (shade, 255 - shade, shade // 2)).save(out, format=kind)
    return out.getvalue()


def _examples(dataset: str, **options) -> tuple[list[str], list[dict]]:
    """(the shards, every example of every shard) as a run gets them: plugin by name, parsed options."""
    cfg = DataConfig(dataset=dataset, options=options)
    names = source.shards(cfg)
    rows = []
    for shard in names:
        for batch in source.examples(cfg, shard):
            assert batch.num_rows <= options.get("batch_rows", 512)
            rows += batch.to_pylist()
    return names, rows


def _fingerprint(dataset: str, **options) -> str:
    plugin = registry.datasets.get(dataset)
    return plugin.fingerprint(plugin.options_type(**options))


def _rewrite(path: Path) -> None:
    """The same bytes written again: a new version of the file, as a re-export makes it."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)


def _folder(root: Path) -> dict[str, bytes]:
    """cat/ and dog/ of PNGs and JPEGs, with files that are not images beside them."""
    files = {"cat/001.png": _image(10), "cat/002.png": _image(20), "dog/001.jpg": _image(30, "JPEG")}
    files |= {"dog/sub/002.jpeg": _image(40, "JPEG"), "dog/003.png": b"not a png at all"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "cat" / ".DS_Store").write_bytes(b"\0")
    (root / "dog" / "notes.txt").write_text("taken in 2019")
    (root / ".ipynb_checkpoints").mkdir()  # hidden: Jupyter's, not a class
    (root / ".ipynb_checkpoints" / "001.png").write_bytes(_image(50))
    return files


def test_image_folder_hands_over_each_files_bytes_with_its_class_and_origin(tmp_path, monkeypatch):
    files = _folder(tmp_path / "photos")
    monkeypatch.chdir(tmp_path)  # a relative path: origins still name the files absolutely
    names, rows = _examples("image_folder", path="photos", files_per_shard=2, batch_rows=1)
    assert names == ["00000", "00001", "00002"]
    assert source.shards(DataConfig(dataset="image_folder", options={"path": "photos", "files_per_shard": 2})) == names
    root = str(tmp_path / "photos")
    assert [(r["_source_key"], r["label"], r["_source_row"], r["_source_file"]) for r in rows] == [
        (key, 0 if key.startswith("cat") else 1, 0, f"{root}/{key}") for key in sorted(files)
    ]
    assert all(r["image"] == files[r["_source_key"]] for r in rows)  # as stored, the corrupt one too
    info = source.info(DataConfig(dataset="image_folder", options={"path": "photos", "height": 4, "width": 4}))
    assert (info.num_classes, info.input_shape, info.input_field) == (2, [3, 4, 4], "image")
    assert decode_image(rows[2]["image"], info.input()).shape == (3, 4, 4)  # a JPEG decodes as the field says


def test_image_folder_classes_fix_the_label_order_and_every_folder_must_be_one(tmp_path):
    _folder(tmp_path)
    _, rows = _examples("image_folder", path=str(tmp_path), classes=["dog", "cat"])
    assert {r["_source_key"].split("/")[0]: r["label"] for r in rows} == {"dog": 0, "cat": 1}
    (tmp_path / "bird").mkdir()
    (tmp_path / "bird" / "1.png").write_bytes(_image(5))
    plugin = registry.datasets.get("image_folder")
    with pytest.raises(ValueError, match=r"subfolder\(s\) \['bird'\] that are not in classes \['dog', 'cat'\]"):
        plugin.info(plugin.options_type(path=str(tmp_path), classes=["dog", "cat"]))
    assert plugin.info(plugin.options_type(path=str(tmp_path))).num_classes == 3


def test_image_folder_refuses_folders_without_images(tmp_path):
    plugin = registry.datasets.get("image_folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty'}.* holds no .png"):
        plugin.info(plugin.options_type(path=str(tmp_path / "empty")))
    _folder(tmp_path / "data")
    (tmp_path / "data" / "bird").mkdir()
    (tmp_path / "data" / "bird" / ".DS_Store").write_bytes(b"\0")
    with pytest.raises(ValueError, match=f"{tmp_path / 'data' / 'bird'} holds no .png, .jpg or .jpeg images"):
        plugin.info(plugin.options_type(path=str(tmp_path / "data")))
    (tmp_path / "data" / "stray.png").write_bytes(_image(1))
    with pytest.raises(ValueError, match="stray.png is not in a class subfolder"):
        plugin.shards(plugin.options_type(path=str(tmp_path / "data")))
    with pytest.raises(ValueError, match="height must be >= 1, got 0"):
        plugin.options_type(path=str(tmp_path), height=0)
    with pytest.raises(ValueError, match="channels must be 1 .grey. or 3 .RGB., got 2"):
        plugin.options_type(path=str(tmp_path), channels=2)


def test_image_folder_fingerprint_changes_when_an_image_is_rewritten_only(tmp_path):
    _folder(tmp_path)
    first = _fingerprint("image_folder", path=str(tmp_path))
    _examples("image_folder", path=str(tmp_path))
    (tmp_path / "cat" / ".DS_Store").write_bytes(b"\1\1")  # not an image: not the data
    assert _fingerprint("image_folder", path=str(tmp_path)) == first
    _rewrite(tmp_path / "cat" / "002.png")
    assert _fingerprint("image_folder", path=str(tmp_path)) != first


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))


def _shards(root: Path) -> dict[tuple[str, str], tuple[bytes | None, int | None]]:
    """Two tar shards, with a sample missing its class, one missing its image, one whose class is
    not a number; returns {(tar name, key): (image, label)}."""
    root.mkdir(parents=True, exist_ok=True)
    a = [("000000.png", _image(1)), ("000000.cls", b"2"), ("000000.json", b"{}"), ("._000001.png", b"mac")]
    a += [("000001.jpg", _image(2, "JPEG")), ("000001.cls", b" 1\n"), ("000002.png", _image(3))]
    b = [("000003.cls", b"0"), ("000004.png", _image(4)), ("000004.cls", b"cat"), ("000005.png", b"corrupt")]
    b += [("000005.cls", b"1")]
    _tar(root / "shard-0000.tar", a)
    _tar(root / "shard-0001.tar", b)
    return {
        ("shard-0000.tar", "000000"): (_image(1), 2),
        ("shard-0000.tar", "000001"): (_image(2, "JPEG"), 1),
        ("shard-0000.tar", "000002"): (_image(3), None),
        ("shard-0001.tar", "000003"): (None, 0),
        ("shard-0001.tar", "000004"): (_image(4), None),
        ("shard-0001.tar", "000005"): (b"corrupt", 1),
    }


def test_webdataset_gives_every_sample_once_with_missing_parts_as_nulls(tmp_path):
    expected = _shards(tmp_path)
    names, rows = _examples("webdataset", path=str(tmp_path), num_classes=3, batch_rows=2)
    assert names == [str(tmp_path / "shard-0000.tar"), str(tmp_path / "shard-0001.tar")]
    found = {(Path(r["_source_file"]).name, r["_source_key"]): (r["image"], r["label"]) for r in rows}
    assert found == expected and len(rows) == len(expected)
    assert [r["_source_row"] for r in rows] == [0, 1, 2, 0, 1, 2]
    _, one = _examples("webdataset", path=str(tmp_path / "shard-0001.tar"), num_classes=3)
    assert one == rows[3:]


def test_webdataset_quarantines_what_it_cannot_use_and_keeps_the_rest(tmp_path):
    _shards(tmp_path)
    cfg = DataConfig(
        dataset="webdataset",
        options={"path": str(tmp_path), "num_classes": 3, "height": 4, "width": 4},
        max_quarantine_fraction=0.9,
    )
    info = source.info(cfg)
    parts = [
        example_prep.prepare_shard(source.examples(cfg, s), cfg, info, i, s) for i, s in enumerate(source.shards(cfg))
    ]
    prepared = example_combine.combine(parts, cfg, info, Reference())
    rows = shards.read_table(prepared.quarantined.dir.path, ["source_file", "source_row", "source_key", "reason"])
    assert [(Path(r["source_file"]).name, r["source_row"], r["source_key"], r["reason"]) for r in rows.to_pylist()] == [
        ("shard-0000.tar", 2, "000002", "label: missing (got null)"),
        ("shard-0001.tar", 0, "000003", "image: missing (got null)"),
        ("shard-0001.tar", 1, "000004", "label: missing (got null)"),
        (
            "shard-0001.tar",
            2,
            "000005",
            "image: decodable (got bytes that are not an image PIL can read (PNG, JPEG, ...))",
        ),
    ]
    assert prepared.report.valid_rows == 2  # 000000 (a PNG) and 000001 (a JPEG)


def test_webdataset_refuses_a_broken_tar_and_an_unknown_class_count(tmp_path):
    plugin = registry.datasets.get("webdataset")
    _shards(tmp_path)
    whole = (tmp_path / "shard-0000.tar").read_bytes()
    (tmp_path / "shard-0000.tar").write_bytes(whole[:1000])  # cut inside the first image
    options = plugin.options_type(path=str(tmp_path), num_classes=3)
    with pytest.raises(ValueError, match="shard-0000.tar is not a readable tar file"):
        list(plugin.examples(options, str(tmp_path / "shard-0000.tar")))
    with pytest.raises(ValueError, match="num_classes is required and must be >= 2, got 0"):
        plugin.options_type(path=str(tmp_path))


def test_webdataset_fingerprint_changes_when_a_shard_is_rewritten_only(tmp_path):
    _shards(tmp_path)
    first = _fingerprint("webdataset", path=str(tmp_path), num_classes=3)
    _examples("webdataset", path=str(tmp_path), num_classes=3)
    assert _fingerprint("webdataset", path=str(tmp_path), num_classes=3) == first
    _rewrite(tmp_path / "shard-0001.tar")
    assert _fingerprint("webdataset", path=str(tmp_path), num_classes=3) != first


def _parquet(root: Path) -> list[tuple[str, bytes | None, int | None, str]]:
    """A Hugging Face export (an Image struct, small row groups) and a file of plain bytes;
    returns (file, image, label, key) of every row in order."""
    root.mkdir(parents=True, exist_ok=True)
    images = [{"bytes": _image(i), "path": f"img_{i}.png"} for i in range(4)]
    images[2]["path"] = None
    images[3] = None
    hf = pa.table({"image": pa.array(images, HF_IMAGE), "label": pa.array([0, 1, 3, 1], pa.int8()), "idx": [0] * 4})
    pq.write_table(hf, root / "train-00000.parquet", row_group_size=3)
    plain = pa.table({"label": [5, None], "image": pa.array([_image(9), b"junk"], pa.binary())})
    pq.write_table(plain, root / "train-00001.parquet")
    first = [("train-00000.parquet", _image(i), [0, 1, 3, 1][i], f"img_{i}.png") for i in range(2)]
    first += [("train-00000.parquet", _image(2), 3, "2"), ("train-00000.parquet", None, 1, "3")]
    return first + [("train-00001.parquet", _image(9), 5, "0"), ("train-00001.parquet", b"junk", None, "1")]


def test_image_parquet_reads_hugging_face_exports_and_plain_bytes(tmp_path):
    expected = _parquet(tmp_path)
    names, rows = _examples("image_parquet", path=str(tmp_path), batch_rows=2)
    assert names == [str(tmp_path / "train-00000.parquet"), str(tmp_path / "train-00001.parquet")]
    found = [(Path(r["_source_file"]).name, r["image"], r["label"], r["_source_key"]) for r in rows]
    assert found == expected
    assert [r["_source_row"] for r in rows] == [0, 1, 2, 3, 0, 1]
    info = source.info(DataConfig(dataset="image_parquet", options={"path": str(tmp_path)}))
    assert (info.num_classes, info.inferred) == (6, ["num_classes"])  # max(label) + 1, the largest in the second file
    given = source.info(DataConfig(dataset="image_parquet", options={"path": str(tmp_path), "num_classes": 10}))
    assert (given.num_classes, given.inferred) == (10, [])


def test_image_parquet_names_the_file_and_column_it_cannot_use(tmp_path):
    plugin = registry.datasets.get("image_parquet")
    pq.write_table(pa.table({"img": [b"x"], "label": [0]}), tmp_path / "a.parquet")
    with pytest.raises(
        ValueError, match=r"a.parquet has no column 'image' \(image_column\); it has \['img', 'label'\]"
    ):
        plugin.info(plugin.options_type(path=str(tmp_path), num_classes=2))
    pq.write_table(pa.table({"image": [b"x"], "label": [0.5]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="column 'label' .label_column. is double; expected integer"):
        list(plugin.examples(plugin.options_type(path=str(tmp_path)), str(tmp_path / "a.parquet")))
    pq.write_table(pa.table({"image": [b"x"], "label": [0]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="cannot infer num_classes .* largest label is 0. Set num_classes"):
        plugin.info(plugin.options_type(path=str(tmp_path)))


def test_image_parquet_fingerprint_changes_when_a_file_is_rewritten_only(tmp_path):
    _parquet(tmp_path)
    first = _fingerprint("image_parquet", path=str(tmp_path))
    _examples("image_parquet", path=str(tmp_path))
    assert _fingerprint("image_parquet", path=str(tmp_path)) == first
    _rewrite(tmp_path / "train-00000.parquet")
    assert _fingerprint("image_parquet", path=str(tmp_path)) != first


def test_s3_gives_the_same_examples_as_local_disk(tmp_path, s3):
    client, bucket = s3
    _folder(tmp_path / "folder")
    _shards(tmp_path / "tars")
    _parquet(tmp_path / "parquet")
    for dirpath, _, names in os.walk(tmp_path):
        for name in names:
            key = os.path.relpath(os.path.join(dirpath, name), tmp_path)
            client.put_object(Bucket=bucket, Key=f"data/{key}", Body=Path(dirpath, name).read_bytes())
    for dataset, folder, options in (
        ("image_folder", "folder", {"files_per_shard": 2}),
        ("webdataset", "tars", {"num_classes": 3}),
        ("image_parquet", "parquet", {}),
    ):
        local = _examples(dataset, path=str(tmp_path / folder), **options)
        remote = _examples(dataset, path=f"s3://{bucket}/data/{folder}", **options)
        here, there = str(tmp_path / folder), f"s3://{bucket}/data/{folder}"
        assert remote[0] == [s.replace(here, there) for s in local[0]] and remote[1]
        assert remote[1] == [r | {"_source_file": r["_source_file"].replace(here, there)} for r in local[1]]
    first = _fingerprint("webdataset", path=f"s3://{bucket}/data/tars", num_classes=3)
    client.put_object(
        Bucket=bucket, Key="data/tars/shard-0001.tar", Body=(tmp_path / "tars/shard-0000.tar").read_bytes()
    )
    assert _fingerprint("webdataset", path=f"s3://{bucket}/data/tars", num_classes=3) != first


def test_an_image_over_max_image_bytes_is_not_read_in_a_folder_or_a_parquet_file(tmp_path):
    small, big = _image(1), _image(2) + b"\0" * 5000  # trailing bytes: PIL would still decode it
    for name, data in (("a/small.png", small), ("a/big.png", big), ("b/small.png", _image(3))):
        (tmp_path / "folder" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "folder" / name).write_bytes(data)
    pq.write_table(pa.table({"image": [small, big], "label": [0, 1]}), tmp_path / "images.parquet")
    cap = len(small) + 100
    over = f"data.options.max_image_bytes {cap}"
    expected = f"image: readable (got {{}} of {len(big)} bytes, over {over}: not read)"
    _, rows = _examples("image_folder", path=str(tmp_path / "folder"), height=4, width=4, max_image_bytes=cap)
    got = [(r["_source_key"], r["image"], r["_source_problem"]) for r in rows]
    assert got == [
        ("a/big.png", None, f"image: readable (got a file of more than {cap} bytes, over {over}: not read)"),
        ("a/small.png", small, None),
        ("b/small.png", _image(3), None),
    ]
    path = str(tmp_path / "images.parquet")
    _, rows = _examples("image_parquet", path=path, num_classes=2, height=4, width=4, max_image_bytes=cap)
    assert [(r["image"], r["_source_problem"]) for r in rows] == [(small, None), (None, expected.format("an image"))]
