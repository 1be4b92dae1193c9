"""Gate decisions: the configured gate plugin judges a candidate's test metrics against the
champion read when the gate runs, and the judgment keeps that champion with the verdict, so
registration can promote on exactly the facts the verdict was made on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from flyscale.champion import ChampionRef
from flyscale.config import GateConfig
from flyscale.contracts import GateVerdict, as_gate_verdict


@dataclass
class Judgment:
    """A gate's verdict and the champion it was judged against."""

    verdict: GateVerdict
    champion: ChampionRef


def judge(cfg: GateConfig, metrics: Mapping[str, float], champion: ChampionRef) -> Judgment:
    """The gate's verdict as flyscale's GateVerdict, whatever object the plugin returned."""
    r = cfg.plugin
    verdict = r.plugin.check(dict(metrics), r.options, champion.for_gate())
    return Judgment(as_gate_verdict(verdict, f"gate {cfg.name!r}"), champion)
