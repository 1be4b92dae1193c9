"""The model a config describes, built by its plugin, and its weights between tasks.

Weights travel as state_dict files, loaded with `weights_only=True` (never pickled modules:
flytekit's torch transformers unpickle, and torch>=2.6 refuses that)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any

import torch
from torch import nn

from flyscale.config import ModelConfig
from flyscale.flyte import content
from flyscale.flyte.outputs import output_dir
from flyscale.plugin.records import DatasetInfo


def as_module(value: Any, what: str) -> nn.Module:
    """`value` if it is a torch module; a TypeError naming the plugin call otherwise."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{what} returned {type(value).__name__}, expected a torch.nn.Module")
    return value


def build_model(cfg: ModelConfig, info: DatasetInfo, *, meta: bool = False) -> nn.Module:
    """A freshly initialised model from the configured plugin; `meta`: shapes only, on the meta
    device, for a strategy that materialises its own part (flyscale.train.meta)."""
    r = cfg.plugin
    with torch.device("meta") if meta else contextlib.nullcontext():
        return as_module(r.plugin.build(r.options, info), f"model {cfg.name!r}: build()")


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(the model's parameters, those that train), each shared tensor counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def kept(cfg: ModelConfig, info: DatasetInfo, path: str) -> tuple[ModelConfig, str]:
    """The trained model as it is handed on, and the config that builds it: a plugin with
    `merged(options, model)` folds into the weights what only training needs (LoRA adapters), so
    evaluation, export, serving and the registry see a plain model. Otherwise `cfg` and `path`."""
    r = cfg.plugin
    merge = r.method("merged")
    # Asked first of the model on the meta device: the same options back is nothing to merge,
    # and the weights (a large model's, in this process) are never loaded for nothing.
    if merge is None or merge(r.options, build_model(cfg, info, meta=True))[0] == r.options:
        return cfg, path
    options, model = merge(r.options, load_state(build_model(cfg, info), path))
    return ModelConfig(name=cfg.name, options=dataclasses.asdict(options), init_from=cfg.init_from), save_state(
        as_module(model, f"model {cfg.name!r}: merged()"), "model.pt"
    )


def save_state(model: nn.Module, name: str) -> str:
    """Write `model`'s state_dict to a fresh file that outlives this process; returns its path."""
    path = str(output_dir("flyscale-weights-") / name)
    torch.save(model.state_dict(), path)
    return path


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes: the identity of a weights file (read once per process: the
    output's content hash reuses it)."""
    return content.file_sha256(path)


def load_state(model: nn.Module, path: str) -> nn.Module:
    """Load weights saved by `save_state` into `model` (same architecture)."""
    with warnings.catch_warnings():
        # torch's own loader of quantized tensors (torch/_utils.py _rebuild_qtensor) reads a
        # TypedStorage's device and warns of its deprecation: nothing of ours to change.
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()
