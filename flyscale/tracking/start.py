"""Warm starts (`model.init_from`, or a pretrained model's own checkpoint): the weights a run
starts from, fetched from MLflow or read from a Hugging Face checkpoint, and held to the model
this run builds before any data is read, so that a mismatch is refused by name instead of
surfacing as a shape error inside a worker."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flyscale.config import ModelConfig
from flyscale.config.sections import START_URI
from flyscale.model import file_sha256
from flyscale.plugin.records import DatasetInfo, as_dataset_info
from flyscale.tracking.model_spec import artifact_files
from flyscale.tracking.store import quiet_artifacts, shown
from flyscale.train.checkpoint_files import tensor_difference


class StartError(ValueError):
    """The weights model.init_from names cannot start this run, and why."""


@dataclass(frozen=True)
class Fetched:
    weights_path: str  # a state_dict file, as flyscale registers it
    sha256: str  # of that file: what training's cache keys on
    source: str  # what init_from named and what it resolved to, for the lineage
    spec: dict  # the registered model's spec (flyscale/tracking/model_spec.py)


def fetch(init_from: str, into: Path, tracking_uri: str) -> Fetched:
    """Download the model `init_from` names (a registered version, by alias or number, or a
    run's model) into `into`, and find its PyTorch weights and spec."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)
    try:
        if init_from.startswith("models:/"):
            name, _, ref = init_from.removeprefix("models:/").replace("@", "/@", 1).partition("/")
            version = (
                client.get_model_version_by_alias(name, ref[1:])
                if ref.startswith("@")
                else client.get_model_version(name, ref)
            )
            model_uri = f"models:/{name}/{version.version}"
            source = f"{init_from}: version {version.version} of {name!r}, from run {version.run_id}"
        else:
            run_id, _, model = init_from.removeprefix("runs:/").partition("/")
            model_uri, source = f"runs:/{run_id}/{model or 'model'}", init_from
        with quiet_artifacts():
            local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(into), tracking_uri=tracking_uri))
    except MlflowException as exc:
        raise StartError(
            f"model.init_from {init_from!r} could not be fetched from MLflow at {shown(tracking_uri)}: {exc.message}"
        ) from None
    files = artifact_files(local)
    if "weights" not in files or "spec" not in files:
        raise StartError(f"model.init_from {init_from!r} ({model_uri}) holds no flyscale weights and spec")
    spec = json.loads(files["spec"].read_text())
    if spec.get("quantizer"):
        raise StartError(
            f"model.init_from {init_from!r} is an int8 model (quantizer {spec['quantizer']['name']!r}); "
            "a run starts from the fp32 model registered beside it (the name without -int8)"
        )
    weights = str(files["weights"])
    return Fetched(weights, file_sha256(weights), source, spec)


def starting_weights(
    model_cfg: ModelConfig,
    model: nn.Module,
    info: DatasetInfo,
    into: Callable[[], Path],
    tracking_uri: Callable[[], str],
) -> Fetched | None:
    """What `model` (built on the meta device) starts from, held to it: the registered model or
    run model.init_from names, a Hugging Face checkpoint it names, or else the pretrained
    checkpoint of the model's plugin (`pretrained`); None for fresh weights. `into()` makes the
    folder the weights are saved in, asked only when there are some (most runs start fresh)."""
    init_from = model_cfg.init_from
    if init_from and START_URI.fullmatch(init_from):
        fetched = fetch(init_from, into(), tracking_uri())
        check(fetched, model, model_cfg, info)
        return fetched
    if init_from:
        return from_huggingface(init_from, model_cfg, model, info, into())
    pretrained = model_cfg.plugin.method("pretrained")
    return (
        from_huggingface(pretrained(model_cfg.plugin.options), model_cfg, model, info, into()) if pretrained else None
    )


def from_huggingface(
    checkpoint: str, model_cfg: ModelConfig, model: nn.Module, info: DatasetInfo, into: Path
) -> Fetched:
    """The weights of a Hugging Face checkpoint (a folder, or a hub id where online) as this run's
    model names them (its plugin's `from_huggingface`), saved as a state_dict file in `into`, and
    held to `model` (built on the meta device)."""
    r = model_cfg.plugin
    read = r.method("from_huggingface")
    if read is None:
        raise StartError(
            f"model {model_cfg.name!r} cannot start from the Hugging Face checkpoint {checkpoint!r}: its plugin "
            "has no from_huggingface(options, info, directory). Use model: huggingface for such a checkpoint"
        )
    try:
        state = read(r.options, info, checkpoint)
    except (OSError, ValueError) as exc:
        raise StartError(f"the Hugging Face checkpoint {checkpoint!r} cannot start this model: {exc}") from None
    have, want = _signature(state), _signature(model.state_dict())
    if have != want:
        raise StartError(
            f"the Hugging Face checkpoint {checkpoint!r} is another architecture than this run builds: "
            f"{tensor_difference(have, want, 'its weights')}"
        )
    into.mkdir(parents=True, exist_ok=True)
    path = into / "weights.pt"
    torch.save(state, path)
    return Fetched(str(path), file_sha256(path), f"the Hugging Face checkpoint {checkpoint}", {})


def check(fetched: Fetched, model: nn.Module, model_cfg: ModelConfig, info: DatasetInfo) -> None:
    """StartError, naming the difference, unless the fetched weights fit `model` (built on the
    meta device from this run's config) and were trained on the same inputs."""
    theirs = as_dataset_info(fetched.spec["info"], f"{fetched.source}'s spec")
    differs = _input_difference(theirs, info)
    if differs:
        raise StartError(f"model.init_from {fetched.source} was trained on other inputs: {differs}")
    saved = torch.load(fetched.weights_path, map_location="cpu", weights_only=True)
    have, want = _signature(saved), _signature(model.state_dict())
    if have != want:
        registered = fetched.spec.get("model", {})
        raise StartError(
            f"model.init_from {fetched.source} is another architecture than this run builds: "
            f"{tensor_difference(have, want, 'the starting weights')}. It is model {registered.get('name')!r} "
            f"with options {registered.get('options')}; this run builds {model_cfg.name!r} with options "
            f"{model_cfg.options}. Set model to match it, or leave model.init_from empty to start afresh"
        )


def _signature(state: Mapping[str, torch.Tensor]) -> list[list]:
    """[name, shape, dtype] of every tensor of a state_dict, sorted: what 'the same architecture' means."""
    return sorted([k, list(v.shape), str(v.dtype)] for k, v in state.items())


def _input_difference(theirs: DatasetInfo, ours: DatasetInfo) -> str:
    """What differs between the inputs (and classes) two models were trained on; "" for nothing."""
    a, b = theirs.input(), ours.input()
    if (a is None) != (b is None):
        kinds = ["columns of features" if f is None else f"field {f}" for f in (a, b)]
        return f"it read {kinds[0]}, this run's data gives {kinds[1]}"
    if a is not None and b is not None and (a.name, a.dtype, list(a.shape)) != (b.name, b.dtype, list(b.shape)):
        return f"it read {a}, this run's data gives {b}"
    if a is None and list(theirs.feature_columns) != list(ours.feature_columns):
        missing = [c for c in theirs.feature_columns if c not in ours.feature_columns]
        extra = [c for c in ours.feature_columns if c not in theirs.feature_columns]
        return (
            f"its {len(theirs.feature_columns)} feature columns are not this run's {len(ours.feature_columns)}"
            + (f" (missing here: {missing[:5]})" if missing else "")
            + (f" (new here: {extra[:5]})" if extra else "")
            + ("" if missing or extra else " (the same columns in another order)")
        )
    if theirs.num_classes != ours.num_classes:
        return f"it predicts {theirs.num_classes} classes, this run's data has {ours.num_classes}"
    return ""
