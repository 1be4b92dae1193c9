"""Validation against a reference: pinned schemas hold later batches, drift is measured and gated,
the quarantine ceiling reports its reasons, and the report is a page a person can read."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from flyscale.config import DataConfig
from flyscale.data import shards
from flyscale.data import source as data
from flyscale.data.drift import psi
from flyscale.data.prepare import prepare_table
from flyscale.data.prepared import DUPLICATE
from flyscale.data.reference import (
    PinnedSchema,
    Reference,
    load_reference,
    reference_json,
)
from flyscale.plugin.contracts import DatasetInfo
from flyscale.render import validation_report
from flyscale.tracking.champion_reference import read_reference


def _info(features=("a", "b"), classes=3, inferred=("features", "num_classes")) -> DatasetInfo:
    return DatasetInfo(
        "t",
        classes,
        [len(features)],
        list(features),
        feature_dtypes={f: "double" for f in features},
        inferred=list(inferred),
    )


def _frame(n=300, seed=0, shift=0.0, features=("a", "b")) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({f: rng.normal(shift, 1.0, n) for f in features})
    frame["label"] = np.arange(n) % 3
    return frame


class Frames:
    """A dataset plugin with no row schema of its own: the checks come from the info alone."""

    def load(self, options):
        raise NotImplementedError  # these tests hand prepare_table() their frames directly

    def info(self, options):
        raise NotImplementedError


@pytest.fixture(autouse=True)
def frames_dataset():
    from flyscale.plugin import registry

    registry.datasets.register("t_frames", Frames())
    yield
    registry.datasets.unregister("t_frames")


def _cfg(**kw) -> DataConfig:
    return DataConfig(dataset="t_frames", **kw)


def _profile(frame: pd.DataFrame, info: DatasetInfo):
    return prepare_table(frame, _cfg(), replace(info, inferred=[])).profile


def _reference(frame: pd.DataFrame, info: DatasetInfo) -> Reference:
    text = reference_json(info, _profile(frame, info))
    return load_reference(text, "v7")


def _quarantined(prepared) -> pd.DataFrame:
    return shards.read(prepared.quarantined.dir.path).sort_values("source_row", ignore_index=True)


def test_a_batch_whose_inferred_columns_differ_from_the_pinned_ones_is_rejected_naming_them():
    ref = _reference(_frame(), _info())
    for features, message in [
        (("a",), r"missing \['b'\]"),
        (("a", "b", "c"), r"added \['c'\]"),
        (("a", "z"), r"missing \['b'\]; added \['z'\]; \(renamed\?\)"),
    ]:
        with pytest.raises(ValueError, match=r"columns differ from the schema pinned with v7 .*" + message):
            prepare_table(_frame(features=features), _cfg(), _info(features), ref)
    retyped = replace(_info(), feature_dtypes={"a": "int64", "b": "double"})
    with pytest.raises(ValueError, match=r"another dtype: \['a \(double -> int64\)'\]"):
        prepare_table(_frame(), _cfg(), retyped, ref)
    # Declared features are the user's word: no pin applies.
    declared = _info(("a", "z"), inferred=())
    assert prepare_table(_frame(features=("a", "z")), _cfg(), declared, ref).report.valid_rows == 300


def test_pinned_classes_hold_a_stray_label_to_quarantine():
    ref = _reference(_frame(), _info())
    frame = _frame()
    frame.loc[10, "label"] = 3
    grown = _info(classes=4)  # what inference alone would now say
    prepared = prepare_table(frame, _cfg(), grown, ref)
    quarantined = _quarantined(prepared)
    assert prepared.info.num_classes == 3
    assert quarantined["source_row"].tolist() == [10] and "label: class in [0, 3)" in quarantined["reason"][0]


def test_drift_is_measured_against_the_reference_and_gated_when_configured():
    info = _info(inferred=())
    ref = _reference(_frame(3000, seed=1), info)
    same = prepare_table(_frame(3000, seed=2), _cfg(), info, ref).report
    moved = prepare_table(_frame(3000, seed=2, shift=1.5), _cfg(), info, ref).report
    assert set(same.drift) == {"a", "b", "label"} and same.reference == "v7"
    assert max(same.drift.values()) < 0.1 < 1.0 < moved.drift["a"]  # stable vs a significant shift
    assert moved.drift["label"] == pytest.approx(0.0, abs=1e-6)  # the labels did not move
    with pytest.raises(
        ValueError, match=r"drifted from v7: PSI above data.max_drift_psi=0.25 for 2 of 3 columns \([ab] \d"
    ):
        prepare_table(_frame(3000, seed=2, shift=1.5), _cfg(max_drift_psi=0.25), info, ref)


def test_a_reference_on_other_bins_is_counted_on_its_bins():
    """A reference recorded on its own bins (an older champion's deciles of its data) is still
    measured against: each column of the new data is counted on the reference's edges."""
    from flyscale.data.reference import FeatureProfile, Profile

    info = _info(inferred=())
    edges = [-3.0, -1.0, 0.0, 1.0, 3.0]
    ref = Reference("v3", profile=Profile(300, {"a": FeatureProfile(edges, [48, 102, 102, 48])}, {"0": 100}))
    prepared = prepare_table(_frame(), _cfg(), info, ref)
    assert prepared.profile.features["a"].edges == edges and sum(prepared.profile.features["a"].counts) == 300
    assert set(prepared.report.drift) == {"a", "label"} and prepared.report.drift["a"] < 0.1


def test_psi_is_zero_for_the_same_histogram_and_grows_with_the_shift():
    assert psi([10, 20, 30], [10, 20, 30]) == 0.0
    assert 0 < psi([10, 20, 30], [12, 20, 28]) < psi([10, 20, 30], [30, 20, 10])


def test_the_ceiling_gives_counts_and_the_commonest_reasons():
    frame, info = data.load(DataConfig())
    frame = frame.copy()
    frame.loc[:150, "pixel_7"] = -1.0
    frame.loc[200:240, "pixel_9"] = np.nan
    with pytest.raises(ValueError) as err:
        prepare_table(frame, DataConfig(), info)
    text = str(err.value)
    assert "192 of 1797 rows failed validation (10.7%)" in text
    assert "pixel_7: in_range(0.0, 16.0) (151 rows)" in text and "pixel_9: not_nullable (41 rows)" in text


def test_duplicates_keep_the_first_and_say_which_row_they_repeat():
    frame = _frame(20)
    frame.loc[7] = frame.loc[2]
    frame.loc[9] = frame.loc[2]
    prepared = prepare_table(frame, _cfg(max_quarantine_fraction=0.5), _info(inferred=()))
    quarantined = _quarantined(prepared)
    assert quarantined["source_row"].tolist() == [7, 9] and prepared.report.valid_rows == 18
    assert quarantined["reason"].tolist() == [f"{DUPLICATE} (t_frames row 2)"] * 2
    assert prepared.report.checks == {DUPLICATE: 2}


def test_the_report_page_shows_checks_examples_drift_and_distributions(tmp_path):
    info = _info(inferred=())
    ref = _reference(_frame(seed=1), info)
    frame = _frame(seed=2, shift=0.5)
    frame.loc[3, "a"] = np.nan
    prepared = prepare_table(frame, _cfg(), info, ref)
    quarantined = _quarantined(prepared)
    out = validation_report.write(prepared.report, quarantined, prepared.profile, ref)
    page = open(f"{out}/validation.html").read()
    assert "300 rows: 299 valid, 1 quarantined" in page and "against v7" in page
    assert "a: not_nullable" in page and "Examples" in page and "Drift (PSI" in page
    assert 'src="data:image/png;base64,' in page
    png = open(f"{out}/distributions.png", "rb").read()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_a_reference_file_is_read_and_a_bad_one_is_named(tmp_path):
    from flyscale.config import MlflowConfig

    info = _info()
    path = tmp_path / "ref.json"
    path.write_text(reference_json(info, _profile(_frame(), info)))
    ref = read_reference(MlflowConfig(), str(path), "sha")
    assert ref.source == str(path) and ref.schema == PinnedSchema(["a", "b"], {"a": "double", "b": "double"}, 3)
    assert json.loads(path.read_text())["profile"]["rows"] == 300
    path.write_text("{}")
    ref = read_reference(MlflowConfig(), str(path), "sha")
    assert ref.schema is None and ref.profile is None
    path.write_text("not json")
    with pytest.raises(ValueError, match=r"ref.json is not a flyscale reference"):
        read_reference(MlflowConfig(), str(path), "sha")
    with pytest.raises(ValueError, match=r"data.reference '.*nope.json' does not exist"):
        read_reference(MlflowConfig(), str(tmp_path / "nope.json"), "sha")


INVARIANTS = """
import numpy as np, pandas as pd, pyarrow as pa
from flyscale.config import DataConfig
from flyscale.data import example_combine, example_prep, table_examples
from flyscale.data.reference import Reference
from flyscale.errors import InvariantBroken
from flyscale.plugin import registry
from flyscale.plugin.contracts import DatasetInfo


class Frames:  # no row schema of its own: rows are checked against the info alone
    def load(self, options): ...
    def info(self, options): ...


registry.datasets.register("t_frames", Frames())
cfg = DataConfig(dataset="t_frames")
info = table_examples.fields_of(DatasetInfo("t", 2, [1], ["a"]))
part = example_prep.prepare_shard([pa.table({"a": np.arange(40.0), "label": np.arange(40) % 2})], cfg, info)
part.quarantined += 1  # one row too many comes back
try:
    example_combine.combine([part], cfg, info, Reference())
except InvariantBroken as exc:
    print(str(exc))
"""


@pytest.mark.slow
def test_the_promised_invariants_are_real_errors_that_python_O_keeps():
    """Rows conserved by validation: checked by an error, not an assert, so that `python -O`
    (which strips every assert) still stops a run that broke it. (Each row goes to exactly one
    split by construction: one hash, three ranges.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-O", "-c", INVARIANTS], capture_output=True, text=True, check=True)
    found = out.stdout.strip().splitlines()[-1]
    assert found.startswith("validation lost examples: 40 in, 40 valid + 1 quarantined out"), out.stdout + out.stderr
    assert "a bug in flyscale" in found


def test_drift_of_wide_data_is_a_few_metrics():
    """An image of 3,072 pixels drifts as a handful of MLflow metrics, not one per pixel."""
    from flyscale.data.drift import WORST_LOGGED, summary

    drift = {f"pixel_{i}": i / 3072 for i in range(3072)} | {"label": 0.01}
    metrics = summary(drift, threshold=0.0)  # 0: the usual 0.25
    assert len(metrics) == 4 + WORST_LOGGED <= 10
    assert metrics["drift_psi_max"] == drift["pixel_3071"] and metrics["drift_threshold"] == 0.25
    assert metrics["drift_features_over_threshold"] == sum(v > 0.25 for k, v in drift.items() if k != "label")
    assert [k for k in metrics if k.startswith("drift_psi_pixel")] == [f"drift_psi_pixel_{3071 - i}" for i in range(5)]
    assert summary({}, 0.25) == {}


def test_the_summary_gives_every_reason_count_or_says_how_many_more():
    from flyscale.render.summary import quarantine_reasons

    checks = {f"f{i}: in_range": 10 - i for i in range(7)}
    text = quarantine_reasons(checks)
    assert text.startswith("f0: in_range: 10, f1: in_range: 9") and "f4: in_range: 6" in text
    assert text.endswith(", and 2 more check(s) on 9 row(s)")  # f5 (5) and f6 (4)
    assert quarantine_reasons({"a": 1}) == "a: 1"
