"""A champion belongs to one kind of model: what its served model takes and what it answers.

Clients of `models:/<name>@champion` send what that model takes (64 digit features, 32x32 RGB
pixels, prompts) and read what it answers (class probabilities, values, text). A candidate of
another kind registered under the name would take its champion and break every one of them, so
it is refused before training (`check`, from check_model) and again before registration
(`refusal`), naming both kinds, unless `mlflow.replace_kind` says to replace the kind.

Every version flyscale registers records its kind in the KIND_TAG tag; a version registered
before the tag is read from the spec its model carries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flyscale.config import MlflowConfig
from flyscale.errors import UserError
from flyscale.plugin.records import DatasetInfo, as_dataset_info

log = logging.getLogger(__name__)

KIND_TAG = "flyscale.kind"  # on each version: ModelKind as JSON
SHOWN_COLUMNS = 6  # a wide table's columns are named by the first few and the last
SEQUENCE_FIELD = "tokens"  # the tokenize step's field (flyscale/data/tokenize.py): a model of text


@dataclass(frozen=True)
class ModelKind:
    """What a model takes (its input) and what it is for (its objective). Two models are of one
    kind when a client can send both the same thing and read their answers the same way."""

    objective: str
    text: bool = False  # takes prompts (a language model): the tokenizer and context length are its own
    dtype: str = ""  # the input's, per example
    shape: tuple[int, ...] = ()
    columns: tuple[str, ...] = ()  # a table's features, in order
    columns_sha256: str = ""  # of the columns: what is compared (`columns` may be cut in a tag)

    @classmethod
    def of(cls, info: DatasetInfo, objective: str) -> ModelKind:
        """The kind of a model of `objective` trained on data `info` describes (as it reaches the
        model: a corpus as the tokenize step's sequences)."""
        field = info.input()
        if field is not None and field.name == SEQUENCE_FIELD and not info.label_column:
            return cls(objective, text=True)
        if field is not None:
            return cls(objective, dtype=field.dtype, shape=tuple(int(d) for d in field.shape))
        columns = tuple(info.feature_columns)
        digest = hashlib.sha256("\n".join(columns).encode()).hexdigest()
        return cls(objective, dtype="float32", shape=(len(columns),), columns=columns, columns_sha256=digest)

    def to_json(self) -> str:
        """The tag's value: whole, unless a wide table's columns would pass MLflow's limit."""
        data = asdict(self)
        if len(json.dumps(data)) > 4000:
            data["columns"] = [*self.columns[: SHOWN_COLUMNS - 1], self.columns[-1]]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelKind:
        data = json.loads(text)
        return cls(
            objective=str(data["objective"]),
            text=bool(data.get("text", False)),
            dtype=str(data.get("dtype", "")),
            shape=tuple(int(d) for d in data.get("shape", ())),
            columns=tuple(str(c) for c in data.get("columns", ())),
            columns_sha256=str(data.get("columns_sha256", "")),
        )

    def same(self, other: ModelKind) -> bool:
        return not self.differences(other)

    def differences(self, other: ModelKind) -> list[str]:
        """How `other` differs from this kind, in words; empty when they are one kind."""
        out = []
        if self.objective != other.objective:
            out.append(f"objective {self.objective} vs {other.objective}")
        if self.text != other.text:
            out.append("text vs numbers" if self.text else "numbers vs text")
        elif not self.text:
            if (self.dtype, self.shape) != (other.dtype, other.shape):
                out.append(f"input {self._tensor()} vs {other._tensor()}")
            elif self.columns_sha256 != other.columns_sha256:
                out.append(_columns_differ(self, other))
        return out

    def _tensor(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def __str__(self) -> str:
        if self.text:
            return f"text prompts ({self.objective})"
        if self.columns_sha256:
            return f"{self.shape[0]} float features ({_named(self.columns, self.shape[0])}; {self.objective})"
        return f"{self._tensor()} ({self.objective})"


def _named(columns: tuple[str, ...], count: int) -> str:
    """The columns, a wide table's by its first few and its last."""
    if count <= SHOWN_COLUMNS or len(columns) < SHOWN_COLUMNS:
        return ", ".join(columns)
    return ", ".join(columns[: SHOWN_COLUMNS - 1]) + f", ..., {columns[-1]}"


def _columns_differ(a: ModelKind, b: ModelKind) -> str:
    """The columns one table has and the other lacks (where both tags hold every column)."""
    before, now = a.columns, b.columns
    if len(before) != a.shape[0] or len(now) != b.shape[0]:
        return "other columns"
    missing = [c for c in before if c not in now]
    added = [c for c in now if c not in before]
    if not missing and not added:
        return "the same columns in another order"
    return "columns " + "; ".join(
        part for part in (f"missing {missing[:5]}" if missing else "", f"added {added[:5]}" if added else "") if part
    )


def version_kind(client, model_name: str, version) -> ModelKind | None:
    """The kind a registered version records, or reads from its model's spec (a version
    registered before the tag); None for a version that is not a flyscale model."""
    tag = version.tags.get(KIND_TAG)
    if tag:
        return ModelKind.from_json(tag)
    spec = _spec(model_name, str(version.version))
    if spec is None:
        return None
    objective = (spec.get("objective") or {}).get("name", "classification")
    return ModelKind.of(as_dataset_info(spec["info"], f"{model_name} v{version.version}'s spec"), objective)


def _spec(model_name: str, version: str) -> dict[str, Any] | None:
    """The spec (model, info, objective) a registered flyscale model carries, or None."""
    import mlflow.artifacts
    import yaml
    from mlflow.exceptions import MlflowException

    from flyscale.tracking.store import tracking_uri

    uri = f"models:/{model_name}/{version}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mlmodel = mlflow.artifacts.download_artifacts(f"{uri}/MLmodel", dst_path=tmp, tracking_uri=tracking_uri())
            flavor = yaml.safe_load(Path(mlmodel).read_text()).get("flavors", {}).get("python_function", {})
            path = (flavor.get("artifacts") or {}).get("spec", {}).get("path")
            if not path:
                return None
            spec = mlflow.artifacts.download_artifacts(f"{uri}/{path}", dst_path=tmp, tracking_uri=tracking_uri())
            return json.loads(Path(spec).read_text())
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                raise  # the store failing is not "no kind": the caller fails closed, retryably
            log.info("%s has no flyscale spec (%s): its kind is unknown", uri, exc)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.info("%s has no readable flyscale spec (%s): its kind is unknown", uri, exc)
    return None


def registered(client, model_name: str, alias: str) -> tuple[Any, ModelKind | None]:
    """(the version the name's kind is read from, its kind): the alias's version, else the
    newest; (None, None) when nothing is registered under the name."""
    from flyscale.tracking.champion import current_version

    version = current_version(client, model_name, alias)
    if version is None:
        found = client.search_model_versions(f"name = '{model_name}'")
        if not found:
            return None, None
        version = max(found, key=lambda v: int(v.version))
    return version, version_kind(client, model_name, version)


def refusal(client, cfg: MlflowConfig, candidate: ModelKind, suggestion: str = "") -> str:
    """Why a model of `candidate`'s kind may not be registered under `cfg.model_name`, or "".
    With mlflow.replace_kind the other kind is replaced, and the log says so."""
    version, kind = registered(client, cfg.model_name, cfg.alias)
    if kind is None or kind.same(candidate):
        return ""
    which = (
        f"'{cfg.alias}' v{version.version}" if cfg.alias in getattr(version, "aliases", []) else f"v{version.version}"
    )
    if cfg.replace_kind:
        log.warning(
            "registering another kind of model under %r (mlflow.replace_kind): %s took %s; this model takes %s",
            cfg.model_name,
            which,
            kind,
            candidate,
        )
        return ""
    other = f"a name of its own (mlflow.model_name: {suggestion})" if suggestion else "a name of its own"
    return (
        f"mlflow.model_name {cfg.model_name!r} holds another kind of model: its {which} takes {kind}, and this "
        f"run's model would take {candidate} ({'; '.join(kind.differences(candidate))}). Whatever serves "
        f"models:/{cfg.model_name}@{cfg.alias} sends what it takes, so a model of another kind never goes under "
        f"that name on its own: give this one {other}, or set mlflow.replace_kind: true to register it under "
        f"{cfg.model_name!r} and replace that kind (the alias still moves only if every gate passes)"
    )


def check(cfg: MlflowConfig, candidate: ModelKind, suggestion: str = "") -> None:
    """Refuse, before any data is read or trained, a model of another kind than the one
    registered under `cfg.model_name` (a UserError, a ValueError, naming both kinds and the
    option); fails closed, retryably, on MLflow errors."""
    from mlflow import MlflowClient

    from flyscale.tracking.store import client_settings, mlflow_errors, tracking_uri

    with client_settings(cfg), mlflow_errors(f"reading the kind of model registered as {cfg.model_name!r}"):
        why = refusal(MlflowClient(tracking_uri()), cfg, candidate, suggestion)
    if why:  # a user's error (a ValueError): the message alone, the traceback when asked for
        raise UserError(why + ". Nothing was read or trained yet")
