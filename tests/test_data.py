"""Data stages as plain functions: quarantine, split, augment (flyscale.data.prepare runs the data
branch's steps in one process)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from flyscale.config import AugmentConfig, DataConfig
from flyscale.data import shards
from flyscale.data import source as data
from flyscale.data.augment import augment
from flyscale.data.prepare import prepare_table, prepared_frames


@pytest.fixture(scope="module")
def digits():
    return data.load(DataConfig())


def test_digits_loads_without_network(digits):
    frame, info = digits
    assert frame.shape == (1797, 65) and info.num_classes == 10 and info.input_shape == [1, 8, 8]


@pytest.mark.slow
def test_digits_are_scikit_learns_rows_read_without_importing_it(digits):
    """flyscale reads the file scikit-learn ships (its import costs a run 2-3 s): the same rows."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    bunch = load_digits()
    np.testing.assert_array_equal(digits[0].drop(columns="label").to_numpy(), bunch.data.astype("float32"))
    np.testing.assert_array_equal(digits[0]["label"].to_numpy(), bunch.target)
    probe = (
        "import sys; from flyscale.data import source as data; from flyscale.config import DataConfig; "
        "data.load(DataConfig()); "
        "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_bad_rows_are_quarantined_with_reasons_and_good_rows_kept(digits):
    frame = digits[0].copy()
    frame.loc[3, "pixel_5"] = 99.0
    frame.loc[10, "label"] = 12
    frame.loc[11, "pixel_0"] = np.nan
    prepared = prepare_table(frame, DataConfig(), digits[1])
    report = prepared.report
    assert (report.total_rows, report.valid_rows, report.quarantined_rows) == (1797, 1794, 3)
    bad = shards.read(prepared.quarantined.dir.path)
    reasons = dict(zip(bad["source_row"], bad["reason"]))
    assert reasons == {
        3: "pixel_5: in_range(0.0, 16.0) (got 99.0)",
        10: "label: isin(range(0, 10)) (got 12.0)",
        11: "pixel_0: not_nullable (got nan)",
    }
    assert bad.loc[bad["source_row"] == 3, "pixel_5"].item() == 99.0  # kept as it came
    # Nothing good is lost: the three splits together are exactly the other rows.
    kept = pd.concat(prepared_frames(prepared)).sort_values("source_row")
    assert kept["source_row"].tolist() == [i for i in range(1797) if i not in (3, 10, 11)]
    expected = frame.drop(index=[3, 10, 11]).reset_index(drop=True)
    pd.testing.assert_frame_equal(kept[expected.columns].reset_index(drop=True), expected, check_dtype=False)


def test_too_many_bad_rows_fail_with_reasons(digits):
    frame = digits[0].copy()
    frame.loc[:200, "pixel_7"] = -1.0
    with pytest.raises(ValueError, match=r"201 of 1797 rows failed validation.*pixel_7"):
        prepare_table(frame, DataConfig(), digits[1])


def test_missing_column_is_a_schema_error_naming_it(digits):
    frame = digits[0].drop(columns=["pixel_9"])
    with pytest.raises(ValueError, match="missing column.*pixel_9"):
        prepare_table(frame, DataConfig(), digits[1])


def test_the_split_is_seeded_by_origin_disjoint_near_stratified_and_whatever_the_chunking(digits):
    """Rows go to a split by a seeded hash of where they came from: the same rows always split
    the same way, read whole or a chunk at a time; each split holds the classes about in
    proportion (not exactly: no split ever sees every row at once)."""
    from flyscale.data import table_examples
    from flyscale.data.prepare import prepare

    frame, info = digits
    cfg = DataConfig()
    train, val, test = prepared_frames(prepare_table(frame, cfg, info))
    ids = [set(p["source_row"]) for p in (train, val, test)]
    assert sum(map(len, ids)) == len(frame) and not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert abs(len(test) / len(frame) - cfg.test_fraction) < 0.03
    assert abs(len(val) / len(frame) - cfg.val_fraction) < 0.03
    overall = frame["label"].value_counts(normalize=True).sort_index()
    for part in (train, val, test):
        assert (part["label"].value_counts(normalize=True).sort_index() - overall).abs().max() < 0.04
    chunks = (frame.iloc[i : i + 250] for i in range(0, len(frame), 250))
    chunked = prepare(table_examples.batches(chunks, info, "digits"), cfg, info)
    assert [set(p["source_row"]) for p in prepared_frames(chunked)] == ids
    other = prepared_frames(prepare_table(frame, DataConfig(seed=1), info))
    assert set(other[2]["source_row"]) != ids[2]


def test_augment_is_deterministic_in_range_and_keeps_originals(digits):
    frame, info = digits
    train = frame.head(200)
    cfg = AugmentConfig(names=["shift", "rotation", "noise"], copies=2, seed=7)
    out = augment(train, info, cfg)
    assert len(out) == 600
    pd.testing.assert_frame_equal(out.head(200), train)  # originals first, untouched
    assert (out["label"].to_numpy() == np.tile(train["label"].to_numpy(), 3)).all()
    pixels = out[info.feature_columns].to_numpy()
    assert pixels.min() >= 0.0 and pixels.max() <= 16.0
    assert not np.allclose(pixels[200:400], pixels[:200])  # the copies really changed
    pd.testing.assert_frame_equal(out, augment(train, info, cfg))
    assert not out.equals(augment(train, info, AugmentConfig(names=cfg.names, copies=2, seed=8)))


def test_shift_moves_pixels_by_whole_steps():
    from flyscale_plugins.augmentations import Shift, ShiftOptions

    x = np.zeros((1, 1, 8, 8), dtype="float32")
    x[0, 0, 4, 4] = 1.0
    out = Shift()(x, np.random.default_rng(0), ShiftOptions(max_shift=2))
    (y,), (xx,) = np.nonzero(out[0, 0])
    assert abs(y - 4) <= 2 and abs(xx - 4) <= 2 and out.sum() == 1.0


def test_a_datasets_kind_is_what_its_plugin_gives_decided_in_one_place(tmp_path):
    """Every later reader (the data branch, config checks, batch prediction) takes the kind from
    source.kind; a text dataset's examples are documents because their input is a string field."""
    from flyscale.plugin.data_kind import DataKind

    csv = tmp_path / "rows.csv"
    pd.DataFrame({"x": [1.0, 2.0], "label": [0, 1]}).to_csv(csv, index=False)
    expected = [
        (DataConfig(dataset="digits"), DataKind.TABLE),
        (DataConfig(dataset="csv_stream", options={"path": str(csv)}), DataKind.TABLE_STREAM),
        (DataConfig(dataset="digits_images"), DataKind.EXAMPLES),
        (DataConfig(dataset="diabetes"), DataKind.EXAMPLES),
        (DataConfig(dataset="python_docs"), DataKind.DOCUMENTS),
    ]
    assert [(cfg.dataset, data.kind(cfg)) for cfg, _ in expected] == [(cfg.dataset, k) for cfg, k in expected]
    assert not DataKind.EXAMPLES.is_table and DataKind.TABLE_STREAM.is_table
