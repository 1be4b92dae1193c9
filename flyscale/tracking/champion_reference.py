"""The reference new data is validated against, read live: a reference file, or the one recorded
with the champion (fails closed: only "no champion" means there is none); and drift measured
again against the champion the gate judged against, when validation used another (`remeasure`),
so that a run never says "no reference yet" of data judged against a champion."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flyscale.config import MlflowConfig
from flyscale.data import field_profile
from flyscale.data.reference import Profile, Reference, load_reference
from flyscale.evaluate.gating import ChampionRef
from flyscale.tracking import champion
from flyscale.tracking.store import (
    DATA_TAG,
    REFERENCE_TAG,
    REFERENCE_URI_TAG,
    client_settings,
    mlflow_errors,
    tracking_uri,
)

log = logging.getLogger(__name__)


def _version_of(source: str) -> str:
    """'v3' -> '3' (a reference from a champion); anything else -> ''."""
    head = source.split(" ")[0]
    return head[1:] if head.startswith("v") and head[1:].isdigit() else ""


def read_reference(cfg: MlflowConfig, reference_file: str, data_sha256: str) -> Reference:
    """What new data is validated against: `reference_file` if given, else the reference recorded
    with the champion (fails closed like the champion read). A champion trained on these very
    bytes is held to what it was itself validated against, so a rerun replays its validation."""
    if reference_file:
        path = Path(reference_file).expanduser()
        if not path.is_file():
            raise ValueError(f"data.reference {reference_file!r} does not exist")
        return load_reference(path.read_text(), str(path))
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    with client_settings(cfg), mlflow_errors(f"reading the data reference of {cfg.model_name!r}"):
        client = MlflowClient(tracking_uri())
        version = champion.current_version(client, cfg.model_name, cfg.alias)
        if version is not None and version.tags.get(DATA_TAG) == data_sha256:
            against = version.tags.get(REFERENCE_TAG, "")
            try:
                version = client.get_model_version(cfg.model_name, against) if against else None
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                version = None
        return Reference() if version is None else _recorded(client, version)


def _recorded(client, version) -> Reference:
    """The reference a registered version recorded: its own data's schema and profile."""
    with tempfile.TemporaryDirectory() as tmp:
        if uri := version.tags.get(REFERENCE_URI_TAG):
            import mlflow.artifacts

            text = Path(
                mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp, tracking_uri=tracking_uri())
            ).read_text()
            return load_reference(text, f"v{version.version}")
        # A version registered before the tag: look in its run.
        run_id = version.tags.get("flyscale.run_id") or version.run_id
        if "data/reference.json" not in {a.path for a in client.list_artifacts(run_id, "data")}:
            return Reference(source=f"v{version.version} (which recorded no reference)")
        text = Path(client.download_artifacts(run_id, "data/reference.json", tmp)).read_text()
    return load_reference(text, f"v{version.version}")


@dataclass
class Remeasured:
    """Drift measured again against the champion the gate judged against, when validation (from
    the cache, or before the champion moved) measured it against another reference."""

    reference: str  # the source the summary names: "v3", or "" for none
    drift: dict[str, float] = field(default_factory=dict)
    note: str = ""  # what was re-measured, from what, and what could not be


def remeasure(cfg: MlflowConfig, judged: ChampionRef, validated_against: str, profile: Profile) -> Remeasured | None:
    """Drift of the data against the reference of `judged` (the champion the gate used), when
    validation measured it against another one; None when they agree or the reference is a file
    (data.reference: the user's choice, whatever the champion).

    They differ when validation replayed an earlier one (a champion trained on these very bytes
    holds them to what it was validated against, and the result may come from the cache) while
    the gate judged this candidate, other weights, against that champion itself; or when the
    champion moved in between. No data is read again: the data's profile is compared bin for bin
    with the champion's recorded one, which is exact where both have the same bins (always for
    typed examples, whose bins are fixed; for a table when the champion was trained on these
    bytes, as in the first case). Histograms on other bins are named as not measured."""
    from_champion = not validated_against or _version_of(validated_against) != ""
    if not from_champion or _version_of(validated_against) == judged.version:
        return None
    if not judged.version:
        return Remeasured(
            "",
            {},
            f"validated against {validated_against}; the gate judged against no champion, so no drift is measured",
        )
    from mlflow import MlflowClient

    with client_settings(cfg), mlflow_errors(f"reading the data reference of {judged.label()}"):
        client = MlflowClient(tracking_uri())
        ref = _recorded(client, client.get_model_version(cfg.model_name, judged.version))
    was = validated_against or "no reference"
    if ref.profile is None:
        return Remeasured(ref.source, {}, f"the gate judged against {judged.label()}, which recorded no data profile")
    drift = field_profile.psi(profile, ref.profile)
    other = sorted(n for n in profile.features if n not in drift)
    note = f"drift measured against {judged.label()}, the champion the gate judged against (validation held the data to {was})"
    if other:
        note += f"; {len(other)} histogram(s) on other bins than {judged.label()}'s not measured ({', '.join(other[:3])}...)"
    return Remeasured(ref.source, drift, note)
