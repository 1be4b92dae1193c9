"""Gate decisions: the configured gate plugin judges a candidate's test metrics."""

from __future__ import annotations

from typing import Mapping

from flyscale.config import GateConfig
from flyscale.contracts import GateVerdict, as_gate_verdict


def judge(cfg: GateConfig, metrics: Mapping[str, float], champion: Mapping[str, float] | None) -> GateVerdict:
    """The gate's verdict as flyscale's GateVerdict, whatever object the plugin returned."""
    r = cfg.plugin
    return as_gate_verdict(r.plugin.check(dict(metrics), r.options, champion), f"gate {cfg.name!r}")
