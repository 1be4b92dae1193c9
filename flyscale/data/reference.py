"""What new data is held to: the schema a model was trained on (pinned with it) and its data's
profile, recorded with every registered model and read back for the next batch."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace

from flyscale.errors import DataError
from flyscale.plugin.records import DatasetInfo

log = logging.getLogger(__name__)


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
    edges: list[float]  # bin edges (fixed per field, or deciles in older references; the outer bins are open-ended)
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
        raise ValueError(
            f"{source} is not a flyscale reference (a JSON object with 'schema' and 'profile'): {exc}"
        ) from exc
    return Reference(source=source, schema=schema, profile=prof)


def pin(info: DatasetInfo, reference: Reference, where: str) -> DatasetInfo:
    """Hold what the dataset inferred to the reference's pinned schema; reject a batch that differs."""
    pinned = reference.schema
    if pinned is None or not info.inferred:
        return info
    if "features" in info.inferred:
        now, then = info.feature_columns, pinned.features
        missing = [c for c in then if c not in now]
        added = [c for c in now if c not in then]
        retyped = [
            f"{c} ({pinned.dtypes[c]} -> {info.feature_dtypes[c]})"
            for c in now
            if c in then
            and c in pinned.dtypes
            and info.feature_dtypes.get(c, "null") != "null"  # no values (an empty file) have no type to differ
            and pinned.dtypes[c] != info.feature_dtypes[c]
        ]
        problems = (
            ([f"missing {missing}"] if missing else [])
            + ([f"added {added}"] if added else [])
            + ([f"another dtype: {retyped}"] if retyped else [])
        )
        if missing and added:
            problems.append("(renamed?)")
        if problems or (not missing and not added and now != then):
            problems = problems or [f"in another order: {now}"]
            raise DataError(
                f"{where}: the columns differ from the schema pinned with {reference.source} "
                f"({len(then)} features): {'; '.join(problems)}. A model for other inputs needs its features "
                f"declared in data.options.features (and a new champion)."
            )
    if "num_classes" in info.inferred and info.num_classes != pinned.num_classes:
        log.warning(
            "%s: %d classes inferred, %d pinned with %s: labels outside 0..%d go to quarantine",
            where,
            info.num_classes,
            pinned.num_classes,
            reference.source,
            pinned.num_classes - 1,
        )
        info = replace(info, num_classes=pinned.num_classes)
    return info
