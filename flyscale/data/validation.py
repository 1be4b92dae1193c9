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

import logging
from collections import Counter
from dataclasses import dataclass, field

import pandas as pd
import pandera.pandas as pa

from flyscale.config import DataConfig
from flyscale.data import shards
from flyscale.data.drift import drift
from flyscale.data.reference import Reference, pin
from flyscale.data.schemas import default_row_schema
from flyscale.errors import DataError, require
from flyscale.plugin.records import SOURCE_FILE, SOURCE_ROW, DatasetInfo

log = logging.getLogger(__name__)


EXAMPLES = 5  # failing rows shown per check in the report


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


def row_schema(cfg: DataConfig, info: DatasetInfo) -> pa.DataFrameSchema:
    """The dataset's own row schema, or the one its info implies when it declares none."""
    r = cfg.plugin
    own = r.method("row_schema")
    if own is None:
        return default_row_schema(info)
    schema = own(r.options)
    if isinstance(schema, type) and issubclass(schema, pa.DataFrameModel):
        schema = schema.to_schema()
    if not isinstance(schema, pa.DataFrameSchema):
        raise TypeError(
            f"dataset {cfg.dataset!r}: row_schema() returned {type(schema).__name__}, "
            "expected a pandera DataFrameSchema or DataFrameModel"
        )
    return schema


def reject_schema_problems(frame: pd.DataFrame, info: DatasetInfo, where: str) -> None:
    """Text where numbers belong rejects the data (a few NaN spellings are values, not text)."""
    columns = [*info.feature_columns, info.label_column]
    for name in columns:
        if name in frame and frame[name].dtype == object:
            parsed = pd.to_numeric(frame[name], errors="coerce")
            text = frame[name][parsed.isna() & frame[name].notna()]
            text = text[~text.astype(str).str.strip().str.lower().isin(("", "nan", "inf", "-inf"))]
            if len(text):
                raise DataError(
                    f"{where}: column {name!r} holds text (e.g. {list(map(str, text.unique()[:3]))}), "
                    f"expected numbers; fix the data"
                )


def _names(values: list[str], most: int = 8) -> str:
    shown = ", ".join(map(repr, values[:most]))
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _schema_level_message(cases: pd.DataFrame, where: str) -> str:
    missing = sorted(str(r.failure_case) for r in cases.itertuples() if r.check == "column_in_dataframe")
    extra = sorted(str(r.failure_case) for r in cases.itertuples() if r.check == "column_in_schema")
    other = sorted(
        {
            f"{r.column or 'dataframe'}: {r.check} ({r.failure_case})"
            for r in cases.itertuples()
            if r.check not in ("column_in_dataframe", "column_in_schema")
        }
    )
    problems = (
        ([f"missing column(s) {_names(missing)}"] if missing else [])
        + ([f"unexpected column(s) {_names(extra)}"] if extra else [])
        + other
    )
    return f"{where} does not match its schema: " + "; ".join(problems)


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
        raise DataError(_schema_level_message(schema_level, where)) from None
    cases = cases.assign(
        row=cases["index"].astype("int64"),
        reason=cases["column"].astype(str)
        + ": "
        + cases["check"].astype(str)
        + " (got "
        + cases["failure_case"].astype(str)
        + ")",
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
    frame: pd.DataFrame,
    cfg: DataConfig,
    info: DatasetInfo,
    reference: Reference | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, ValidationReport, DatasetInfo]:
    """(valid rows, quarantined rows with reasons, the report, the info held to the reference)."""
    reference = reference or Reference()
    where = f"dataset {cfg.dataset!r}"
    data = frame.drop(columns=[c for c in (SOURCE_FILE, SOURCE_ROW) if c in frame])
    if data.empty:  # before the pinned schema, which would call every column of an empty CSV retyped (null)
        raise DataError(f"{where} holds no rows (empty): there is nothing to validate or train on")
    pinned_info = pin(info, reference, where)
    reject_schema_problems(data, pinned_info, where)
    schema = row_schema(cfg, pinned_info)
    validated, reasons = row_failures(data, schema, where)
    duplicates = _duplicates(data, data.index.difference(reasons.index))
    reasons = pd.concat([reasons, duplicates]).sort_index()
    if validated is None:  # some rows failed: the others pass on their own (and are coerced) now
        validated = schema.validate(data[~data.index.isin(reasons.index)], lazy=False)
    clean = validated.drop(index=duplicates.index, errors="ignore").reset_index(drop=True)
    quarantined = quarantine_rows(frame, data, reasons, cfg.dataset)
    require(
        len(clean) + len(quarantined) == len(frame),
        f"validation lost rows: {len(frame)} in, {len(clean)} valid + {len(quarantined)} quarantined out",
    )
    checks = Counter(name for reason in reasons for name in check_names(reason))
    report = ValidationReport(
        total_rows=len(frame),
        valid_rows=len(clean),
        quarantined_rows=len(quarantined),
        checks=dict(checks),
        reference=reference.source,
        pinned_classes=pinned_info.num_classes != info.num_classes,
    )
    try:
        enforce_ceiling(report, cfg)
    except CeilingExceeded as exc:
        exc.quarantine_dir = shards.write(quarantined, "quarantine").dir.path
        raise
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


class CeilingExceeded(DataError):
    """More rows were quarantined than `data.max_quarantine_fraction` allows. It carries the
    report and the quarantined rows' directory (set by whoever wrote them), so that the rows and
    their reasons are kept even though the data is rejected."""

    def __init__(self, message: str, report: ValidationReport) -> None:
        super().__init__(message)
        self.report, self.quarantine_dir = report, ""


def enforce_ceiling(report: ValidationReport, cfg: DataConfig) -> None:
    if report.quarantined_rows > cfg.max_quarantine_fraction * report.total_rows:
        raise CeilingExceeded(
            f"{report.quarantined_rows} of {report.total_rows} rows failed validation "
            f"({report.quarantined_rows / report.total_rows:.1%}), more than data.max_quarantine_fraction="
            f"{cfg.max_quarantine_fraction}. Commonest reasons: {_commonest(report)}",
            report,
        )


def enforce_drift(report: ValidationReport, cfg: DataConfig) -> None:
    if cfg.max_drift_psi <= 0 or not report.drift:
        return
    over = {k: v for k, v in report.drift.items() if v > cfg.max_drift_psi}
    if over:
        worst = ", ".join(f"{k} {v:.3f}" for k, v in sorted(over.items(), key=lambda kv: -kv[1])[:5])
        raise DataError(
            f"the data drifted from {report.reference}: PSI above data.max_drift_psi={cfg.max_drift_psi} for "
            f"{len(over)} of {len(report.drift)} columns ({worst}). Check the data source, or raise the threshold "
            f"if the change is expected."
        )
