"""What validation of any kind of data shares: its report, the quarantine ceiling and the drift
gate, and a table's checks by its pandera row schema.

Schema-level problems cannot be fixed by dropping rows, so they reject the data with an error
naming the column and what was expected: a missing or extra column, text in a numeric column,
or a schema that differs from the one pinned with the reference model. Row-level problems (NaN,
inf, a value out of range, a label outside the classes) send the row to quarantine with its
original values, where it came from and why; the other rows go on (flyscale/data/example_prep.py,
which also quarantines exact duplicates). Too large a quarantined share fails the run with the
counts and the commonest reasons; drift past a configured threshold fails it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pandas as pd
import pandera.pandas as pa

from flyscale.config import DataConfig
from flyscale.data.schemas import default_row_schema
from flyscale.errors import DataError
from flyscale.plugin.records import DatasetInfo

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


DUPLICATE = "duplicate: the same values as an earlier row"  # then, in brackets, which: its file and row


def check_names(reason: str) -> list[str]:
    """'pixel_3: in_range(0, 16) (got 99.0); label: ...' -> ['pixel_3: in_range(0, 16)', 'label: ...'];
    a duplicate, whichever example it repeats, is one check."""
    return [DUPLICATE if part.startswith(DUPLICATE) else part.rsplit(" (got ", 1)[0] for part in reason.split("; ")]


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
