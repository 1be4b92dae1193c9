"""A config as the flat `{"train.lr": 0.002, ...}` MLflow params want, and as the whole
effective config (every plugin's options with its defaults filled in) logged as config.yaml."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

from flyscale.config.pipeline import PipelineConfig
from flyscale.config.plugins import plain


def effective(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as a nested dict, each plugin's options filled in with the plugin's defaults."""
    out = asdict(cfg)
    for section in ("data", "model", "objective", "train", "quantize"):
        out[section]["options"] = plain(getattr(cfg, section).plugin.options)
    out["gate"]["gates"] = [{"name": g.name, "options": plain(g.plugin.options)} for g in cfg.gate.gates]
    out["augment"]["options"] = {r.name: plain(r.options) for r in cfg.augment.plugins if r.options is not None}
    return out


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """`{"train.lr": 0.002, ...}`: the shape MLflow params and the compare view want.

    A PipelineConfig is flattened as `effective` gives it, so a plugin default shows as a param.
    """
    out: dict[str, Any] = {}
    if isinstance(cfg, PipelineConfig):
        cfg = effective(cfg)
    items = asdict(cfg).items() if is_dataclass(cfg) and not isinstance(cfg, type) else cfg.items()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))  # an empty one adds no name: {} is not a value
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out.update(flatten({str(i): v for i, v in enumerate(value)}, f"{name}."))  # gate.gates.0.name
        else:
            out[name] = value
    return out
