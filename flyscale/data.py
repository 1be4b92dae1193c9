"""Data preparation as plain functions on DataFrames: validate with quarantine, split, augment."""

from __future__ import annotations

import logging
from dataclasses import dataclass
import numpy as np
import pandas as pd
import pandera.pandas as pa
import torch

from flyscale.config import AugmentConfig, DataConfig
from flyscale.training import TrainData
from plugins import registry
from plugins.protocols import DatasetInfo, parse_options

log = logging.getLogger(__name__)


@dataclass
class ValidationReport:
    """Counts a person reads in the summary and MLflow."""

    total_rows: int
    valid_rows: int
    quarantined_rows: int


def load(cfg: DataConfig) -> tuple[pd.DataFrame, DatasetInfo]:
    """Load the configured dataset and its shape facts."""
    plugin = registry.datasets.get(cfg.dataset)
    options = parse_options(plugin, cfg.options, "data.options")
    frame = plugin.load(options).reset_index(drop=True)
    return frame, plugin.info(options)


def validate(frame: pd.DataFrame, cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame, ValidationReport]:
    """Split rows into (valid, quarantined-with-reasons) using the dataset's row schema.

    Schema-level problems (a missing or extra column) cannot be fixed by dropping rows, so they
    fail at once; row-level failures are quarantined, and too many of them fail the run.
    """
    plugin = registry.datasets.get(cfg.dataset)
    schema: pa.DataFrameSchema = plugin.row_schema(parse_options(plugin, cfg.options, "data.options"))
    try:
        valid = schema.validate(frame, lazy=True)
        bad = pd.DataFrame({"row": pd.Series(dtype="int64"), "reason": pd.Series(dtype="str")})
    except pa.errors.SchemaErrors as exc:
        cases = exc.failure_cases
        row_level = cases[cases["index"].notna()]
        schema_level = cases[cases["index"].isna()]
        if len(schema_level):
            problems = "; ".join(
                f"{r.column or 'dataframe'}: {r.check} ({r.failure_case})" for r in schema_level.itertuples()
            )
            raise ValueError(f"dataset {cfg.dataset!r} does not match its schema: {problems}") from None
        reasons = (
            row_level.assign(
                row=row_level["index"].astype("int64"),
                reason=row_level["column"].astype(str) + ": " + row_level["check"].astype(str)
                + " (got " + row_level["failure_case"].astype(str) + ")",
            )
            .groupby("row")["reason"]
            .apply(lambda r: "; ".join(sorted(set(r))))
            .reset_index()
        )
        bad = reasons
        valid = schema.validate(frame.drop(index=reasons["row"]), lazy=False)
    report = ValidationReport(len(frame), len(valid), len(bad))
    if report.quarantined_rows > cfg.max_quarantine_fraction * report.total_rows:
        raise ValueError(
            f"{report.quarantined_rows} of {report.total_rows} rows failed validation, more than "
            f"data.max_quarantine_fraction={cfg.max_quarantine_fraction}; first reasons: "
            + " | ".join(bad["reason"].head(3))
        )
    if report.quarantined_rows:
        log.warning("quarantined %d of %d rows", report.quarantined_rows, report.total_rows)
    return valid.reset_index(drop=True), bad, report


def split(frame: pd.DataFrame, cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded train/validation/test split."""
    from sklearn.model_selection import train_test_split

    rest, test = train_test_split(frame, test_size=cfg.test_fraction, stratify=frame["label"], random_state=cfg.seed)
    val_share = cfg.val_fraction / (1.0 - cfg.test_fraction)
    train, val = train_test_split(rest, test_size=val_share, stratify=rest["label"], random_state=cfg.seed)
    return tuple(part.reset_index(drop=True) for part in (train, val, test))  # type: ignore[return-value]


def augment(train: pd.DataFrame, info: DatasetInfo, cfg: AugmentConfig) -> pd.DataFrame:
    """Originals plus `cfg.copies` augmented copies of each row; a pure function of (rows, cfg)."""
    if cfg.copies == 0 or not cfg.names:
        return train.copy()
    rng = np.random.default_rng(cfg.seed)
    x = train[info.feature_columns].to_numpy(dtype="float32").reshape(-1, *info.input_shape)
    copies = []
    for _ in range(cfg.copies):
        out = x.copy()
        for name in cfg.names:
            plugin = registry.augmentations.get(name)
            out = plugin(out, rng, parse_options(plugin, cfg.options.get(name), f"augment.options.{name}"))
        frame = pd.DataFrame(out.reshape(len(out), -1), columns=info.feature_columns)
        frame[info.label_column] = train[info.label_column].to_numpy()
        copies.append(frame)
    return pd.concat([train, *copies], ignore_index=True)


def train_data(train: pd.DataFrame, val: pd.DataFrame, info: DatasetInfo) -> TrainData:
    """The training and validation splits as the tensors strategies train on."""
    return TrainData(*to_tensors(train, info), *to_tensors(val, info))


def to_tensors(frame: pd.DataFrame, info: DatasetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(features float32 flattened, labels int64)."""
    x = torch.from_numpy(frame[info.feature_columns].to_numpy(dtype="float32"))
    y = torch.from_numpy(frame[info.label_column].to_numpy(dtype="int64"))
    return x, y

