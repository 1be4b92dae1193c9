"""The reference new data is validated against, read live: a reference file, or the one recorded
with the champion (fails closed: only "no champion" means there is none)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from flyscale.config import MlflowConfig
from flyscale.data.reference import Reference, load_reference
from flyscale.tracking import champion
from flyscale.tracking.store import (
    DATA_TAG,
    REFERENCE_TAG,
    REFERENCE_URI_TAG,
    client_settings,
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

    with client_settings(cfg), champion.mlflow_errors(f"reading the data reference of {cfg.model_name!r}"):
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
        if version is None:
            return Reference()
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
