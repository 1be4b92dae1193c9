"""The `parquet` and `csv` datasets and flyscale's validation, file by file and row by row.

Every bad-input kind gives either a quarantine with a row-level reason, or a rejection naming the
column or the file; in CSV and in Parquet, on local disk and in S3 (a real moto server on
loopback), with the features declared or inferred. Valid plus quarantined is always the input.
"""

from __future__ import annotations

import io
import os
import sys
from importlib.metadata import entry_points

import numpy as np
import pandas as pd
import pytest

from flyscale.config import DataConfig
from flyscale.data import shards
from flyscale.data import source as data
from flyscale.data.prepare import prepare_table, prepared_frames
from flyscale_plugins.tabular import TabularOptions, parquet

pytestmark = pytest.mark.timeout(180)

FEATURES = ["f0", "f1", "f2"]


def _frame(seed: int, n: int = 30) -> pd.DataFrame:
    """Three features in [0, 1) and a `target` of classes 0..2 (every class present)."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.random((n, 3)), columns=FEATURES)
    frame["target"] = np.arange(n) % 3
    return frame


def _bytes(frame: pd.DataFrame, fmt: str) -> bytes:
    if fmt == "csv":
        return frame.to_csv(index=False).encode()
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()


# How the second shard goes bad: each returns the spoiled frame.
def _nan(f):
    f.loc[4, "f0"] = np.nan
    return f


def _inf(f):
    f.loc[4, "f2"] = np.inf
    return f


def _out_of_range(f):
    f.loc[4, "f1"] = 7.5
    return f


def _bad_label(f):
    f.loc[4, "target"] = 7
    return f


def _duplicate(f):
    f.loc[4, FEATURES + ["target"]] = f.loc[1, FEATURES + ["target"]].to_numpy()
    return f


def _missing(f):
    return f.drop(columns=["f1"])


def _extra(f):
    return f.assign(f3=0.5)


def _text(f):
    f["f1"] = f["f1"].astype(str)  # a text column, as a file written from text would hold
    f.loc[4, "f1"] = "abc"
    return f


ROW_LEVEL = {
    "nan": (_nan, "f0: not_nullable"),
    "inf": (_inf, "f2: finite"),
    "out_of_range": (_out_of_range, "f1: in_range"),
    "label_outside_classes": (_bad_label, "label: class in [0, 3)"),
    "duplicate": (_duplicate, "duplicate: the same values as an earlier row"),
}
SCHEMA_LEVEL = {
    "missing_column": (_missing, "has no column 'f1'"),
    "extra_column": (_extra, "unexpected column(s) ['f3']"),
    "text_in_numeric": (_text, "column 'f1' holds"),
}


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """Where shards are written and how their URI is spelled: a directory, or an S3 prefix on moto."""
    if request.param == "local":
        root = tmp_path / "shards"
        root.mkdir()

        def put(name: str, body: bytes) -> None:
            (root / name).write_bytes(body)

        return str(root), put
    client, bucket = request.getfixturevalue("s3")
    return f"s3://{bucket}/shards", lambda name, body: client.put_object(Bucket=bucket, Key=f"shards/{name}", Body=body)


def _cfg(path: str, fmt: str, declared: bool, **extra) -> DataConfig:
    options = {"path": path, "label": "target", "ranges": {"f1": [0.0, 1.0]}}
    if declared:
        options.update(features=FEATURES, num_classes=3)
    options.update(extra)
    return DataConfig(dataset=fmt, options=options, max_quarantine_fraction=0.5)


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "inferred"])
@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("kind", list(ROW_LEVEL))
@pytest.mark.slow
def test_row_level_failures_are_quarantined_with_file_row_and_reason(place, fmt, declared, kind):
    root, put = place
    spoil, check = ROW_LEVEL[kind]
    put(f"a.{fmt}", _bytes(_frame(1), fmt))
    put(f"b.{fmt}", _bytes(spoil(_frame(2)), fmt))
    cfg = _cfg(root, fmt, declared)
    frame, info = data.load(cfg)
    prepared = prepare_table(frame, cfg, info)
    report, quarantined = prepared.report, shards.read(prepared.quarantined.dir.path)
    assert report.valid_rows + len(quarantined) == len(frame) == 60  # nothing lost
    (row,) = quarantined.itertuples()
    assert check in row.reason, row.reason
    assert row.source_file == f"{root}/b.{fmt}" and row.source_row == 4
    assert report.quarantined_rows == 1 and sum(report.checks.values()) == 1
    assert info.num_classes == 3  # a stray label does not make a bigger classifier


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "inferred"])
@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("kind", list(SCHEMA_LEVEL))
def test_schema_level_failures_reject_the_data_naming_the_file_and_column(place, fmt, declared, kind):
    root, put = place
    spoil, message = SCHEMA_LEVEL[kind]
    put(f"a.{fmt}", _bytes(_frame(1), fmt))
    put(f"b.{fmt}", _bytes(spoil(_frame(2)), fmt))
    with pytest.raises(ValueError) as err:
        data.load(_cfg(root, fmt, declared))
    assert message in str(err.value) and f"{root}/b.{fmt}" in str(err.value), str(err.value)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_unreadable_and_truncated_files_are_named(place, fmt):
    root, put = place
    put(f"a.{fmt}", _bytes(_frame(1), fmt))
    whole = _bytes(_frame(2), fmt)
    put(f"b.{fmt}", whole[: len(whole) // 2] if fmt == "parquet" else b"f0,f1\n1,2,3,4\n\x00\x01")
    with pytest.raises(ValueError) as err:
        data.load(_cfg(root, fmt, True))
    text = str(err.value)
    assert f"{root}/b.{fmt}" in text
    assert (
        ("not a readable Parquet file" in text)
        if fmt == "parquet"
        else ("not readable as CSV" in text or "has" in text)
    )


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_an_empty_dataset_is_rejected(place, fmt):
    """Called empty, also where a champion's pinned schema would otherwise see every column of a
    header-only CSV retyped (its columns read as null)."""
    from flyscale.data.reference import PinnedSchema, Reference

    root, put = place
    put(f"a.{fmt}", _bytes(_frame(1).head(0), fmt))
    cfg = _cfg(root, fmt, False, num_classes=3)  # the features (and their types) inferred
    frame, info = data.load(cfg)
    pinned = Reference("v1", PinnedSchema(FEATURES, dict.fromkeys(FEATURES, "double"), 3))
    for reference in (None, pinned):
        with pytest.raises(ValueError, match=r"holds no rows \(empty\)"):
            prepare_table(frame, cfg, info, reference)


def test_inferred_features_name_the_file_and_the_column_it_lacks(tmp_path):
    _frame(1).drop(columns=["f1"]).to_csv(tmp_path / "a.csv", index=False)  # the first file: features come from it
    _frame(2).to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(ValueError, match=r"a\.csv has no column 'f1', which .*b\.csv has"):
        data.load(_cfg(str(tmp_path), "csv", False, ranges={}))
    (tmp_path / "b.csv").unlink()  # alone, a numbered run of columns shows the gap
    with pytest.raises(ValueError, match=r"input_shape \[3\] holds 3 values, and there are 2 features .*'f1' missing"):
        data.load(_cfg(str(tmp_path), "csv", False, ranges={}, input_shape=[3]))


def test_a_text_column_never_silently_vanishes_from_inferred_features(tmp_path):
    frame = _frame(1).assign(city="oslo")
    frame.to_parquet(tmp_path / "a.parquet", index=False)
    with pytest.raises(ValueError, match=r"column 'city' holds string values .*list the column in data.options.ignore"):
        data.load(_cfg(str(tmp_path), "parquet", False))
    _, info = data.load(_cfg(str(tmp_path), "parquet", False, ignore=["city"]))
    assert info.feature_columns == FEATURES and info.inferred == ["features", "num_classes"]


def test_local_and_s3_give_the_same_frame_info_and_split(s3, tmp_path):
    """The same files in a folder here and uploaded to S3: the same rows, and each in the same
    split (the split hashes a file's path below data.options.path, not the whole path)."""
    client, bucket = s3
    for i in range(2):
        body = _bytes(_frame(i, n=200), "parquet")
        (tmp_path / f"part-{i}.parquet").write_bytes(body)
        client.put_object(Bucket=bucket, Key=f"data/shards/part-{i}.parquet", Body=body)
    client.put_object(Bucket=bucket, Key="data/shards/_SUCCESS", Body=b"")  # other keys are skipped
    # A sibling prefix that merely starts with the same letters must not be read.
    client.put_object(Bucket=bucket, Key="data/shards-old/part-0.parquet", Body=_bytes(_frame(9), "parquet"))
    local, local_info = data.load(_cfg(str(tmp_path), "parquet", False))
    remote, remote_info = data.load(_cfg(f"s3://{bucket}/data/shards", "parquet", False))
    data_columns = [*FEATURES, "label", "_source_row"]
    pd.testing.assert_frame_equal(local[data_columns], remote[data_columns], check_exact=True)
    assert (local_info.feature_columns, local_info.num_classes) == (
        remote_info.feature_columns,
        remote_info.num_classes,
    )

    def splits(frame: pd.DataFrame, info, path: str) -> list[set[tuple[str, int]]]:
        parts = prepared_frames(prepare_table(frame, _cfg(path, "parquet", False), info))
        return [{(name.rsplit("/", 1)[1], row) for name, row in zip(p.source_file, p.source_row)} for p in parts]

    here, there = splits(local, local_info, str(tmp_path)), splits(remote, remote_info, f"s3://{bucket}/data/shards")
    assert here == there and all(40 <= len(s) <= 300 for s in here), [len(s) for s in here]


def test_s3_errors_name_the_path_and_what_to_do(s3):
    client, bucket = s3
    with pytest.raises(
        ValueError, match=r"s3://no-such-bucket-here/x.*the bucket .no-such-bucket-here. does not exist"
    ):
        data.load(_cfg("s3://no-such-bucket-here/x", "parquet", True))
    client.put_object(Bucket=bucket, Key="empty/readme.txt", Body=b"hi")
    with pytest.raises(ValueError, match=rf"'s3://{bucket}/empty' holds no \.parquet or \.pq files"):
        data.load(_cfg(f"s3://{bucket}/empty", "parquet", True))


@pytest.mark.timeout(240)
def test_wrong_credentials_are_an_access_error(tmp_path, monkeypatch):
    """A moto server that checks signatures: made-up keys are refused, and the message says so."""
    from tests.conftest import free_port, serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto's switch: authenticate every request
    with serve(
        [sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
        f"{url}/moto-api/",
        tmp_path / "moto.log",
        timeout=60,
    ):
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(ValueError, match=r"access denied\. Check the credentials"):
            data.load(_cfg("s3://some-bucket/x", "parquet", True))


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_failing_s3_is_retried_then_recoverable(s3, monkeypatch):
    """503 on every request (a proxy in front of moto): retried by the AWS SDK, then a
    Flyte-recoverable error so Flyte's task retries apply."""
    from flytekit.exceptions.user import FlyteRecoverableException

    from tests.faults import FaultProxy, fail_all

    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"], rule=fail_all)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with pytest.raises(FlyteRecoverableException, match=r"failed after 5 attempts"):
            data.load(_cfg(f"s3://{s3[1]}/x", "parquet", True))
        assert len(proxy.failed) >= 5
    finally:
        proxy.close()


@pytest.fixture(params=["local", "s3"])
def rewritable(request, tmp_path):
    """(the data's URI, put(name, bytes), rewrite(name, bytes)): rewrite overwrites a file as
    `cp -p` or an upload tool would, keeping its modification time (S3: within the same second)."""
    if request.param == "local":
        root = tmp_path / "nightly"
        root.mkdir()

        def put(name: str, body: bytes) -> None:
            (root / name).write_bytes(body)

        def rewrite(name: str, body: bytes) -> None:
            before = (root / name).stat()
            (root / name).write_bytes(body)
            os.utime(root / name, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert (root / name).stat().st_mtime_ns == before.st_mtime_ns

        return str(root), put, rewrite
    client, bucket = request.getfixturevalue("s3")

    def put_object(name: str, body: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"nightly/{name}", Body=body)

    return f"s3://{bucket}/nightly", put_object, put_object


@pytest.mark.parametrize("content_hash", [False, True], ids=["listing", "content_hash"])
def test_fingerprint_changes_whenever_the_bytes_can_have_changed(rewritable, content_hash):
    """The same size, the old mtime, other bytes: a new fingerprint (ctime and inode locally, the
    ETag on S3, or the bytes' sha256). Unchanged, it stays the same."""
    uri, put, rewrite = rewritable
    body = [_bytes(_frame(i), "parquet") for i in range(2)]
    for i in range(2):
        put(f"part-{i}.parquet", body[i])
    cfg = _cfg(uri, "parquet", True, content_hash=content_hash)
    first = data.fingerprint(cfg)
    assert data.fingerprint(cfg).value == first.value
    swapped = body[0][::-1]  # other bytes of the same size: the fingerprint never reads them as Parquet
    assert len(swapped) == len(body[0]) and swapped != body[0]
    rewrite("part-0.parquet", swapped)
    assert data.fingerprint(cfg).value != first.value


def test_a_content_hash_ignores_a_rewrite_of_the_same_bytes(tmp_path):
    """With content_hash the key is the bytes alone: written again, the same key."""
    (tmp_path / "part-0.parquet").write_bytes(_bytes(_frame(0), "parquet"))
    cfg = _cfg(str(tmp_path), "parquet", True, content_hash=True)
    first = data.fingerprint(cfg).value
    (tmp_path / "part-0.parquet").write_bytes((tmp_path / "part-0.parquet").read_bytes())
    assert data.fingerprint(cfg).value == first
    assert data.fingerprint(_cfg(str(tmp_path), "parquet", True)).value != first  # by the listing it is another key


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, r"data\.options\.path is required"),
        ({"path": "  "}, r"data\.options\.path is required"),
        ({"path": "x", "nope": 1}, r"data\.options\.nope: unknown option"),
        ({"path": "x", "format": "xlsx"}, r"data\.options\.format must be one of parquet, csv"),
        ({"path": "x", "ranges": {"f0": [2, 1]}}, r"data\.options\.ranges\.f0"),
        ({"path": "x", "features": ["a"], "ranges": {"b": [0, 1]}}, r"data\.options\.ranges\.b"),
        ({"path": "x", "features": ["a", "b"], "input_shape": [3]}, r"input_shape"),
        ({"path": "x", "label": "y", "features": ["a", "label"]}, r"data\.options\.features must not include"),
        ({"path": "x", "features": ["a"], "ignore": ["a"]}, r"data\.options\.ignore names a feature"),
    ],
)
def test_bad_options_fail_at_config_time(options, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(dataset="parquet", options=options)


def test_declared_features_choose_order_and_shape(tmp_path):
    _frame(1).to_parquet(tmp_path / "a.parquet", index=False)
    frame, info = data.load(
        _cfg(
            str(tmp_path),
            "parquet",
            True,
            features=["f2", "f0"],
            ignore=["f1"],
            input_shape=[1, 2],
            num_classes=5,
            ranges={},
        )
    )
    assert list(frame.columns)[:3] == ["f2", "f0", "label"]
    assert (info.num_classes, info.input_shape, info.feature_columns, info.inferred) == (5, [1, 2], ["f2", "f0"], [])


def test_a_fractional_label_is_quarantined_not_truncated(tmp_path):
    frame = _frame(4, n=20)
    frame["target"] = (np.arange(20) % 2).astype("float64")
    frame.loc[3, "target"] = 1.5
    frame.to_parquet(tmp_path / "f.parquet", index=False)
    cfg = _cfg(str(tmp_path), "parquet", False, ranges={})
    frame, info = data.load(cfg)
    prepared = prepare_table(frame, cfg, info)
    quarantined = shards.read(prepared.quarantined.dir.path)
    assert quarantined["source_row"].tolist() == [3] and "1.5" in quarantined["reason"][0]
    assert prepared.report.valid_rows == 19


def test_both_formats_are_entry_points():
    """The built-ins register like a third-party plugin would (pyproject + reinstall)."""
    eps = {ep.name: ep.value for ep in entry_points(group="flyscale.datasets")}
    assert eps.get("parquet") == "flyscale_plugins.tabular:parquet" and eps.get("csv") == "flyscale_plugins.tabular:csv"


def test_a_programming_error_is_not_reported_as_unreadable_data(tmp_path, monkeypatch):
    """Only pyarrow's and AWS's own errors are translated; a bug surfaces as itself."""
    from flyscale_plugins import sources

    _frame(1).to_parquet(tmp_path / "a.parquet")
    monkeypatch.setattr(sources, "filesystem", lambda uri: None)  # a bug: no filesystem
    with pytest.raises(AttributeError):
        parquet.load(TabularOptions(path=str(tmp_path)))
