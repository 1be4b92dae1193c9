"""The `parquet` dataset plugin: local shards, row quarantine, clear errors, and s3:// through a
real moto S3 server process on loopback (boto3 finds it through AWS_ENDPOINT_URL)."""

from __future__ import annotations

import time
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flyscale import data
from flyscale.config import DataConfig
from flyscale_plugins.parquet import ParquetOptions, parquet

pytestmark = pytest.mark.timeout(120)

FEATURES = ["f0", "f1", "f2"]


def _shard(seed: int, n: int = 30) -> pd.DataFrame:
    """Three float features in [0, 1), an int `target` in 0..2 and a text column to be ignored."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.random((n, 3)), columns=FEATURES)
    frame["target"] = np.arange(n) % 3
    frame["note"] = [f"row {i}" for i in range(n)]
    return frame


@pytest.fixture
def shards(tmp_path) -> tuple[Path, list[pd.DataFrame]]:
    """A directory holding two Parquet shards, written by pandas."""
    root = tmp_path / "shards"
    root.mkdir()
    frames = [_shard(1), _shard(2)]
    for i, frame in enumerate(frames):
        frame.to_parquet(root / f"part-{i}.parquet", index=False)
    (root / "README.txt").write_text("not a shard")  # other files are ignored
    return root, frames


def _expected(frames: list[pd.DataFrame]) -> pd.DataFrame:
    both = pd.concat(frames, ignore_index=True)
    return both[FEATURES + ["target"]].rename(columns={"target": "label"})


def _cfg(**options) -> DataConfig:
    return DataConfig(dataset="parquet", options=options, max_quarantine_fraction=0.5)


# --- local files -------------------------------------------------------------------------


def test_local_directory_loads_every_shard_in_order(shards):
    root, frames = shards
    frame, info = data.load(_cfg(path=str(root), label="target"))
    pd.testing.assert_frame_equal(frame, _expected(frames))
    # Features inferred: every numeric column but the label (the text column is left out).
    assert info.feature_columns == FEATURES
    assert info.num_classes == 3 and info.input_shape == [3] and info.label_column == "label"


def test_single_file_and_declared_features_shape(shards):
    root, frames = shards
    cfg = _cfg(path=str(root / "part-1.parquet"), label="target", features=["f2", "f0"], num_classes=5, input_shape=[1, 2])
    frame, info = data.load(cfg)
    expected = frames[1][["f2", "f0", "target"]].rename(columns={"target": "label"})
    pd.testing.assert_frame_equal(frame, expected)
    assert (info.num_classes, info.input_shape, info.feature_columns) == (5, [1, 2], ["f2", "f0"])


def test_bad_rows_are_quarantined_with_reasons_and_good_rows_kept(tmp_path):
    good = _shard(3, n=40)
    bad = good.copy()
    bad.loc[2, "f0"] = np.nan  # null
    bad.loc[5, "f1"] = 7.5  # outside the declared range
    bad.loc[9, "target"] = 9  # not a class
    bad.loc[11, "f2"] = np.inf  # not finite
    (tmp_path / "d").mkdir()
    good.to_parquet(tmp_path / "d" / "a.parquet")
    bad.to_parquet(tmp_path / "d" / "b.parquet")
    cfg = _cfg(path=str(tmp_path / "d"), label="target", num_classes=3, ranges={"f1": [0.0, 1.0]})

    frame, info = data.load(cfg)
    valid, quarantined, report = data.validate(frame, cfg, info)

    offset = len(good)  # rows of b.parquet follow those of a.parquet
    reasons = dict(zip(quarantined["row"], quarantined["reason"]))
    assert sorted(reasons) == [offset + 2, offset + 5, offset + 9, offset + 11]
    assert reasons[offset + 2].startswith("f0: not_nullable")
    assert reasons[offset + 5].startswith("f1: in_range") and "7.5" in reasons[offset + 5]
    assert reasons[offset + 9].startswith("label:") and "9" in reasons[offset + 9]
    assert reasons[offset + 11].startswith("f2:") and "finite" in reasons[offset + 11]
    assert (report.total_rows, report.valid_rows, report.quarantined_rows) == (80, 76, 4)
    kept = _expected([good, bad.drop(index=[2, 5, 9, 11])])
    pd.testing.assert_frame_equal(valid, kept, check_dtype=False)


def test_fractional_label_is_quarantined_not_truncated(tmp_path):
    frame = _shard(4, n=20)[FEATURES]
    frame["label"] = (np.arange(20) % 2).astype("float64")
    frame.loc[3, "label"] = 1.5
    frame.to_parquet(tmp_path / "f.parquet")
    cfg = _cfg(path=str(tmp_path / "f.parquet"))
    frame, info = data.load(cfg)
    valid, quarantined, _ = data.validate(frame, cfg, info)
    assert quarantined["row"].tolist() == [3] and "1.5" in quarantined["reason"][0]
    assert len(valid) == 19


def test_missing_feature_column_names_the_column_and_the_file(shards):
    root, _ = shards
    with pytest.raises(ValueError, match=r"part-0\.parquet has no column 'f9'"):
        data.load(_cfg(path=str(root), label="target", features=["f0", "f9"]))


def test_missing_label_column_is_an_error(shards):
    root, _ = shards
    with pytest.raises(ValueError, match=r"no column 'label'.*data\.options\.label"):
        data.load(_cfg(path=str(root)))  # the default label column name is not in these files


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, r"data\.options\.path is required"),
        ({"path": "  "}, r"data\.options\.path is required"),
        ({"path": "x", "nope": 1}, r"data\.options\.nope: unknown option"),
        ({"path": "x", "ranges": {"f0": [2, 1]}}, r"data\.options\.ranges\.f0"),
        ({"path": "x", "features": ["a"], "ranges": {"b": [0, 1]}}, r"data\.options\.ranges\.b"),
        ({"path": "x", "features": ["a", "b"], "input_shape": [3]}, r"input_shape"),
        ({"path": "x", "label": "y", "features": ["a", "label"]}, r"data\.options\.features must not include"),
    ],
)
def test_bad_options_fail_at_config_time(options, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(dataset="parquet", options=options)


def test_missing_path_and_empty_directory_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"'.*nowhere' does not exist"):
        data.load(_cfg(path=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"'.*empty' holds no \.parquet files"):
        data.load(_cfg(path=str(tmp_path / "empty")))


# --- s3:// through a real moto server --------------------------------------------------------


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """A boto3 client on the moto server, with the env the plugin's own boto3 client reads."""
    import boto3

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3")
    bucket = f"flyscale-{time.monotonic_ns()}"  # fresh bucket per test: nothing leaks between tests
    client.create_bucket(Bucket=bucket)
    return client, bucket


def test_s3_prefix_loads_exactly_what_local_files_hold(shards, s3):
    client, bucket = s3
    root, _ = shards
    for path in sorted(root.glob("*.parquet")):
        client.upload_file(str(path), bucket, f"data/shards/{path.name}")
    client.put_object(Bucket=bucket, Key="data/shards/_SUCCESS", Body=b"")  # non-parquet keys are skipped
    # A sibling prefix that merely starts with the same letters must not be read.
    client.upload_file(str(root / "part-0.parquet"), bucket, "data/shards-old/part-0.parquet")

    local_frame, local_info = data.load(_cfg(path=str(root), label="target"))
    s3_frame, s3_info = data.load(_cfg(path=f"s3://{bucket}/data/shards", label="target"))

    pd.testing.assert_frame_equal(s3_frame, local_frame, check_exact=True)
    assert (s3_info.num_classes, s3_info.input_shape, s3_info.feature_columns) == (
        local_info.num_classes, local_info.input_shape, local_info.feature_columns,
    )
    valid, quarantined, _ = data.validate(s3_frame, _cfg(path=f"s3://{bucket}/data/shards", label="target"), s3_info)
    assert len(valid) == 60 and quarantined.empty


def test_s3_prefix_without_parquet_names_the_path(s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="empty/readme.txt", Body=b"hi")
    with pytest.raises(ValueError, match=rf"'s3://{bucket}/empty' holds no \.parquet files"):
        data.load(_cfg(path=f"s3://{bucket}/empty"))


def test_s3_missing_bucket_names_the_path(s3):
    with pytest.raises(ValueError, match=r"'s3://no-such-bucket-here/x'.*NoSuchBucket"):
        parquet.load(ParquetOptions(path="s3://no-such-bucket-here/x"))


def test_parquet_is_declared_as_an_entry_point():
    """The built-in registers like a third-party plugin would (pyproject + reinstall)."""
    eps = {ep.name: ep.value for ep in entry_points(group="flyscale.datasets")}
    assert eps.get("parquet") == "flyscale_plugins.parquet:parquet", (
        'add  parquet = "flyscale_plugins.parquet:parquet"  under [project.entry-points."flyscale.datasets"] '
        "in pyproject.toml, then `pip install -e .` so the installed metadata lists it"
    )


def test_s3_fingerprint_sees_new_bytes_under_the_same_prefix(shards, s3):
    """Taken from the listing alone (ETag and size): same bytes, same fingerprint; one changed byte, a new one."""
    client, bucket = s3
    root, _ = shards
    for path in sorted(root.glob("*.parquet")):
        client.upload_file(str(path), bucket, f"nightly/{path.name}")
    cfg = _cfg(path=f"s3://{bucket}/nightly", label="target")
    first = data.fingerprint(cfg)
    client.upload_file(str(root / "part-0.parquet"), bucket, "nightly/part-0.parquet")  # the same bytes again
    assert data.fingerprint(cfg).value == first.value
    changed = pd.read_parquet(root / "part-0.parquet")
    changed.iloc[0, 0] += 1.0
    client.put_object(Bucket=bucket, Key="nightly/part-0.parquet", Body=changed.to_parquet(index=False))
    assert data.fingerprint(cfg).value != first.value
    client.put_object(Bucket=bucket, Key="nightly/part-9.parquet", Body=changed.to_parquet(index=False))  # a new shard
    assert len({first.value, data.fingerprint(cfg).value}) == 2


def test_a_programming_error_is_not_reported_as_unreadable_s3(s3, monkeypatch):
    """Only boto's own errors become "cannot be read from S3"; a bug surfaces as itself."""
    from flyscale_plugins import parquet as module

    monkeypatch.setattr(module, "_s3_client", lambda: None)  # a bug: no client at all
    with pytest.raises(AttributeError):
        parquet.load(ParquetOptions(path=f"s3://{s3[1]}/x"))
