"""Prove the data is what its schema says before a model sees it, and account for every row.

Schema-level problems cannot be fixed by dropping rows, so they reject the data with an error
naming the column and what was expected: no rows, a missing or extra column, text in a numeric
column, or a schema that differs from the one pinned with the reference model. Row-level
problems (NaN, inf, a value out of range, a label outside the classes, an exact duplicate) send
the row to quarantine with its original values, where it came from and why; the other rows go
on. Valid plus quarantined is the input, always, and too large a quarantined share fails the run
with the counts and the commonest reasons. Drift of each feature, and of the labels, against the
reference profile is measured (PSI) and, past a configured threshold, fails the run too.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd
import pandera.pandas as pa

from flyscale.config import DataConfig
from flyscale.contracts import SOURCE_FILE, SOURCE_ROW, DatasetInfo
from flyscale.schemas import default_row_schema

log = logging.getLogger(__name__)

BINS = 10  # reference histograms: deciles of the reference data
EXAMPLES = 5  # failing rows shown per check in the report


@dataclass
class PinnedSchema:
    """The schema a model was trained on, recorded with it; later inferred batches must match it."""

    features: list[str]
    dtypes: dict[str, str]
    num_classes: int

    @classmethod
    def of(cls, info: DatasetInfo) -> PinnedSchema:
        return cls(list(info.feature_columns), dict(info.feature_dtypes), info.num_classes)


@dataclass
class FeatureProfile:
    edges: list[float]  # bin edges (the reference's deciles; the outer bins are open-ended)
    counts: list[int]


@dataclass
class Profile:
    """A dataset's distribution: per-feature histograms and label counts."""

    rows: int
    features: dict[str, FeatureProfile] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)


@dataclass
class Reference:
    """What new data is held to: the champion's pinned schema and profile (or a file's)."""

    source: str = ""  # "v3" (a champion version), a file path, or "" for no reference
    schema: PinnedSchema | None = None
    profile: Profile | None = None


@dataclass
class ValidationReport:
    """Counts and drift a person reads in the summary, the Deck and MLflow."""

    total_rows: int
    valid_rows: int
    quarantined_rows: int
    checks: dict[str, int] = field(default_factory=dict)  # quarantined rows per failed check
    drift: dict[str, float] = field(default_factory=dict)  # PSI per feature and "label", vs the reference
    reference: str = ""  # what the drift was measured against ("" = nothing)
    pinned_classes: bool = False  # the classes came from the reference's pinned schema


def reference_json(info: DatasetInfo, data_profile: Profile) -> str:
    """What a model records as the reference for later batches: its pinned schema and its data's profile."""
    return json.dumps({"schema": asdict(PinnedSchema.of(info)), "profile": asdict(data_profile)}, indent=1)


def load_reference(text: str, source: str) -> Reference:
    """A reference from what `reference_json` wrote; `source` names where it came from."""
    from mashumaro.codecs.basic import BasicDecoder

    try:
        data = json.loads(text)
        schema = BasicDecoder(PinnedSchema).decode(data["schema"]) if data.get("schema") else None
        prof = BasicDecoder(Profile).decode(data["profile"]) if data.get("profile") else None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{source} is not a flyscale reference (a JSON object with 'schema' and 'profile'): {exc}") from exc
    return Reference(source=source, schema=schema, profile=prof)


def row_schema(cfg: DataConfig, info: DatasetInfo) -> pa.DataFrameSchema:
    """The dataset's own row schema, or the one its info implies when it declares none."""
    r = cfg.plugin
    if not hasattr(r.plugin, "row_schema"):
        return default_row_schema(info)
    schema = r.plugin.row_schema(r.options)
    if isinstance(schema, type) and issubclass(schema, pa.DataFrameModel):
        schema = schema.to_schema()
    if not isinstance(schema, pa.DataFrameSchema):
        raise TypeError(f"dataset {cfg.dataset!r}: row_schema() returned {type(schema).__name__}, "
                        "expected a pandera DataFrameSchema or DataFrameModel")
    return schema


# --- schema level: reject, naming the column ----------------------------------------------------


def pin(info: DatasetInfo, reference: Reference, where: str) -> DatasetInfo:
    """Hold what the dataset inferred to the reference's pinned schema; reject a batch that differs."""
    pinned = reference.schema
    if pinned is None or not info.inferred:
        return info
    if "features" in info.inferred:
        now, then = info.feature_columns, pinned.features
        missing = [c for c in then if c not in now]
        added = [c for c in now if c not in then]
        retyped = [f"{c} ({pinned.dtypes[c]} -> {info.feature_dtypes[c]})" for c in now
                   if c in then and c in pinned.dtypes and c in info.feature_dtypes
                   and pinned.dtypes[c] != info.feature_dtypes[c]]
        problems = ([f"missing {missing}"] if missing else []) + ([f"added {added}"] if added else []) + (
            [f"another dtype: {retyped}"] if retyped else [])
        if missing and added:
            problems.append("(renamed?)")
        if problems or (not missing and not added and now != then):
            problems = problems or [f"in another order: {now}"]
            raise ValueError(
                f"{where}: the columns differ from the schema pinned with {reference.source} "
                f"({len(then)} features): {'; '.join(problems)}. A model for other inputs needs its features "
                f"declared in data.options.features (and a new champion)."
            )
    if "num_classes" in info.inferred and info.num_classes != pinned.num_classes:
        log.warning("%s: %d classes inferred, %d pinned with %s: labels outside 0..%d go to quarantine",
                    where, info.num_classes, pinned.num_classes, reference.source, pinned.num_classes - 1)
        info = replace(info, num_classes=pinned.num_classes)
    return info


def reject_schema_problems(frame: pd.DataFrame, info: DatasetInfo, where: str) -> None:
    """Text where numbers belong rejects the data (a few NaN spellings are values, not text)."""
    columns = [*info.feature_columns, info.label_column]
    for name in columns:
        if name in frame and frame[name].dtype == object:
            parsed = pd.to_numeric(frame[name], errors="coerce")
            text = frame[name][parsed.isna() & frame[name].notna()]
            text = text[~text.astype(str).str.strip().str.lower().isin(("", "nan", "inf", "-inf"))]
            if len(text):
                raise ValueError(
                    f"{where}: column {name!r} holds text (e.g. {list(map(str, text.unique()[:3]))}), "
                    f"expected numbers; fix the data"
                )


def _names(values: list[str], most: int = 8) -> str:
    shown = ", ".join(map(repr, values[:most]))
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _schema_level_message(cases: pd.DataFrame, where: str) -> str:
    missing = sorted(str(r.failure_case) for r in cases.itertuples() if r.check == "column_in_dataframe")
    extra = sorted(str(r.failure_case) for r in cases.itertuples() if r.check == "column_in_schema")
    other = sorted({f"{r.column or 'dataframe'}: {r.check} ({r.failure_case})" for r in cases.itertuples()
                    if r.check not in ("column_in_dataframe", "column_in_schema")})
    problems = ([f"missing column(s) {_names(missing)}"] if missing else []) + (
        [f"unexpected column(s) {_names(extra)}"] if extra else []) + other
    return f"{where} does not match its schema: " + "; ".join(problems)


# --- row level: quarantine, with the reason ----------------------------------------------------


def row_failures(data: pd.DataFrame, schema: pa.DataFrameSchema, where: str) -> tuple[pd.DataFrame | None, pd.Series]:
    """(the validated frame when every row passed, {row index: reason} of every failing row).

    Schema-level failures raise.
    """
    try:
        return schema.validate(data, lazy=True), pd.Series(dtype="str")
    except pa.errors.SchemaErrors as exc:
        cases = exc.failure_cases
    schema_level = cases[cases["index"].isna()]
    if len(schema_level):
        raise ValueError(_schema_level_message(schema_level, where)) from None
    cases = cases.assign(
        row=cases["index"].astype("int64"),
        reason=cases["column"].astype(str) + ": " + cases["check"].astype(str)
        + " (got " + cases["failure_case"].astype(str) + ")",
    )
    return None, cases.groupby("row")["reason"].apply(lambda r: "; ".join(sorted(set(r))))


def _duplicates(data: pd.DataFrame, candidates: pd.Index) -> pd.Series:
    """{row index: reason} for exact duplicates among `candidates`, the first of each kept."""
    rows = data.loc[candidates]
    dupes = rows.duplicated(keep="first")
    if not dupes.any():
        return pd.Series(dtype="str")
    # The row each duplicate repeats: the first with the same content hash.
    digest = pd.util.hash_pandas_object(rows, index=False).to_numpy()
    first = pd.Series(rows.index, index=rows.index).groupby(digest).transform("first")
    return pd.Series({i: f"duplicate: the same values as row {first[i]}" for i in rows.index[dupes]}, dtype="str")


def check_names(reason: str) -> list[str]:
    """'pixel_3: in_range(0, 16) (got 99.0); label: ...' -> ['pixel_3: in_range(0, 16)', 'label: ...']."""
    return [part.rsplit(" (got ", 1)[0] for part in reason.split("; ")]


def validate(
    frame: pd.DataFrame, cfg: DataConfig, info: DatasetInfo, reference: Reference | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, ValidationReport, DatasetInfo]:
    """(valid rows, quarantined rows with reasons, the report, the info held to the reference)."""
    reference = reference or Reference()
    where = f"dataset {cfg.dataset!r}"
    pinned_info = pin(info, reference, where)
    data = frame.drop(columns=[c for c in (SOURCE_FILE, SOURCE_ROW) if c in frame])
    if data.empty:
        raise ValueError(f"{where} holds no rows: there is nothing to validate or train on")
    reject_schema_problems(data, pinned_info, where)
    schema = row_schema(cfg, pinned_info)
    validated, reasons = row_failures(data, schema, where)
    duplicates = _duplicates(data, data.index.difference(reasons.index))
    reasons = pd.concat([reasons, duplicates]).sort_index()
    if validated is None:  # some rows failed: the others pass on their own (and are coerced) now
        validated = schema.validate(data[~data.index.isin(reasons.index)], lazy=False)
    clean = validated.drop(index=duplicates.index, errors="ignore").reset_index(drop=True)
    quarantined = quarantine_rows(frame, data, reasons, cfg.dataset)
    assert len(clean) + len(quarantined) == len(frame), "validation lost rows"  # the invariant, checked
    checks = Counter(name for reason in reasons for name in check_names(reason))
    report = ValidationReport(
        total_rows=len(frame), valid_rows=len(clean), quarantined_rows=len(quarantined), checks=dict(checks),
        reference=reference.source, pinned_classes=pinned_info.num_classes != info.num_classes,
    )
    enforce_ceiling(report, cfg)
    if report.quarantined_rows:
        log.warning("quarantined %d of %d rows: %s", report.quarantined_rows, report.total_rows, _commonest(report))
    if reference.profile is not None:
        report.drift = drift(clean, pinned_info, reference.profile)
        enforce_drift(report, cfg)
    return clean, quarantined, report, pinned_info


def quarantine_rows(frame: pd.DataFrame, data: pd.DataFrame, reasons: pd.Series, dataset: str) -> pd.DataFrame:
    """The rejected rows as they came in, with where they came from and why."""
    rows = reasons.index.to_numpy(dtype="int64")
    out = data.loc[rows].reset_index(drop=True)
    out.insert(0, "reason", reasons.to_numpy(dtype=str))
    out.insert(0, "source_row", frame.loc[rows, SOURCE_ROW].to_numpy() if SOURCE_ROW in frame else rows)
    out.insert(0, "source_file", frame.loc[rows, SOURCE_FILE].to_numpy() if SOURCE_FILE in frame else dataset)
    out.insert(0, "row", rows)
    return out


def _commonest(report: ValidationReport, n: int = 3) -> str:
    top = sorted(report.checks.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} ({count} rows)" for name, count in top)


def enforce_ceiling(report: ValidationReport, cfg: DataConfig) -> None:
    if report.quarantined_rows > cfg.max_quarantine_fraction * report.total_rows:
        raise ValueError(
            f"{report.quarantined_rows} of {report.total_rows} rows failed validation "
            f"({report.quarantined_rows / report.total_rows:.1%}), more than data.max_quarantine_fraction="
            f"{cfg.max_quarantine_fraction}. Commonest reasons: {_commonest(report)}"
        )


# --- profiles and drift ------------------------------------------------------------------------


def profile(frame: pd.DataFrame, info: DatasetInfo) -> Profile:
    """Decile histograms of every feature, and the label counts: the reference for later batches."""
    out = Profile(rows=len(frame))
    for name in info.feature_columns:
        values = frame[name].to_numpy(dtype="float64")
        edges = np.unique(np.quantile(values, np.linspace(0, 1, BINS + 1))) if len(values) else np.array([0.0])
        out.features[name] = FeatureProfile(edges=[float(e) for e in edges], counts=histogram(values, edges))
    labels = frame[info.label_column].astype("int64").value_counts()
    out.labels = {str(k): int(labels.get(k, 0)) for k in range(info.num_classes)}
    return out


def histogram(values: np.ndarray, edges: np.ndarray) -> list[int]:
    """Counts in the bins between `edges`, the first and last open-ended (new data may go beyond)."""
    inner = np.asarray(edges)[1:-1]
    return np.bincount(np.searchsorted(inner, values, side="right"), minlength=len(inner) + 1).tolist()


def psi(expected: list[int], actual: list[int], eps: float = 1e-4) -> float:
    """Population stability index between two histograms on the same bins."""
    e = np.asarray(expected, dtype="float64")
    a = np.asarray(actual, dtype="float64")
    e = np.clip(e / max(e.sum(), 1), eps, None)
    a = np.clip(a / max(a.sum(), 1), eps, None)
    return float(np.sum((a - e) * np.log(a / e)))


def drift(frame: pd.DataFrame, info: DatasetInfo, ref: Profile) -> dict[str, float]:
    """PSI of each feature the reference profiled, and of the labels, for `frame` against `ref`."""
    out = {}
    for name, fp in ref.features.items():
        if name in frame:
            out[name] = psi(fp.counts, histogram(frame[name].to_numpy(dtype="float64"), np.asarray(fp.edges)))
    labels = frame[info.label_column].astype("int64").value_counts()
    classes = sorted(set(ref.labels) | {str(k) for k in labels.index})
    out["label"] = psi([ref.labels.get(c, 0) for c in classes], [int(labels.get(int(c), 0)) for c in classes])
    return out


def enforce_drift(report: ValidationReport, cfg: DataConfig) -> None:
    if cfg.max_drift_psi <= 0 or not report.drift:
        return
    over = {k: v for k, v in report.drift.items() if v > cfg.max_drift_psi}
    if over:
        worst = ", ".join(f"{k} {v:.3f}" for k, v in sorted(over.items(), key=lambda kv: -kv[1])[:5])
        raise ValueError(
            f"the data drifted from {report.reference}: PSI above data.max_drift_psi={cfg.max_drift_psi} for "
            f"{len(over)} of {len(report.drift)} columns ({worst}). Check the data source, or raise the threshold "
            f"if the change is expected."
        )
