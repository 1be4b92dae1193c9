"""Gate decisions: every configured gate plugin judges the candidate's numbers against the
champion read when the gates run, and the judgment keeps that champion with the verdicts, so
registration can promote on exactly the facts the verdicts were made on. A model is published
only when every gate passed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flyscale.config import GateConfig, GatesConfig
from flyscale.plugin.records import GateVerdict, as_gate_verdict


@dataclass
class ChampionRef:
    """The champion a candidate is judged against; `version == ""` when there is none."""

    model_name: str
    alias: str
    version: str = ""
    run_id: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # its test metrics, without the test_ prefix
    test_sha256: str = ""  # the fingerprint of the test data those metrics were measured on
    # Its metrics on the candidate's test split, scored through its registered model
    # (flyscale/tracking/same_split.py) for a gate that compares with it; {} when not scored.
    scored: dict[str, float] = field(default_factory=dict)
    unscored: str = ""  # why it could not be scored there ("" when it was, or when no gate compares)
    other_kind: str = ""  # its kind, when it is another than the candidate's and mlflow.replace_kind replaces it

    def label(self) -> str:
        return f"v{self.version}" if self.version else "no champion"

    def test_data(self, test_sha256: str) -> str:
        """How the champion's test data compares with a candidate's: "same", "other", or
        "unknown" (no champion, or a fingerprint missing on either side)."""
        if not (self.version and self.test_sha256 and test_sha256):
            return "unknown"
        return "same" if self.test_sha256 == test_sha256 else "other"

    def for_gate(self, test_data: str) -> dict[str, float] | None:
        """What a gate plugin receives: the champion's metrics and version, and whether they were
        measured on this run's test data (1.0, or 0.0 when it is known to be other data), or None
        when there is no champion. Scored on this run's split: those metrics, and `scored` 1.0;
        not scoreable there: its recorded metrics, `scored` 0.0 (and `other_kind` 1.0 when it is
        another kind that mlflow.replace_kind replaces). `test_data` is `self.test_data(...)`."""
        if not self.version:
            return None
        if self.scored:
            return {**self.scored, "version": float(self.version), "same_test_data": 1.0, "scored": 1.0}
        out = {**self.metrics, "version": float(self.version), "same_test_data": 0.0 if test_data == "other" else 1.0}
        if self.unscored or self.other_kind:
            out["scored"] = 0.0
        if self.other_kind:
            out["other_kind"] = 1.0
        return out

    def split_line(self, test_sha256: str, match: str) -> str:
        """Which test data the champion's numbers come from, in words ("" = no champion)."""
        if not self.version:
            return ""
        recorded = (
            "the same split"
            if match == "same"
            else f"its own test split ({self.test_sha256[:12]})"
            if match == "other"
            else "a test split it recorded no fingerprint of"
        )
        if self.scored:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in list(self.scored.items())[:3])
            return (
                f"this run's test split ({test_sha256[:12]}): champion {self.label()} was scored on it through its "
                f"registered model ({shown}); the metrics it recorded are from {recorded}"
            )
        if self.other_kind:
            return (
                f"champion {self.label()} is another kind of model ({self.other_kind}), replaced as "
                f"mlflow.replace_kind says: not scored on this run's test split ({test_sha256[:12]})"
            )
        if self.unscored:
            return (
                f"champion {self.label()} could not be scored on this run's test split ({test_sha256[:12]}): "
                f"{self.unscored}. Its recorded metrics are from {recorded}"
            )
        if match == "unknown":
            return f"champion {self.label()} recorded no test-data fingerprint: compared as given"
        if match == "same":
            return f"the same test data as champion {self.label()} ({test_sha256[:12]})"
        return (
            f"OTHER test data than champion {self.label()} (its {self.test_sha256[:12]}, this "
            f"run's {test_sha256[:12]}): its metrics were measured on its own test set"
        )


@dataclass
class Judgment:
    """Every gate's verdict, whether all passed, and the champion they were judged against."""

    verdicts: list[GateVerdict]
    champion: ChampionRef
    passed: bool = False
    test_data: str = ""  # how the test data compared with the champion's, in words ("" = no champion)
    failed: list[str] = field(default_factory=list)  # the failed gates' reasons
    # Drift measured again against `champion`, when validation had measured it against another
    # reference (flyscale/tracking/champion_reference.py remeasure): what the summary and MLflow then show.
    remeasured: bool = False
    reference: str = ""  # the reference drift was measured against ("" = none)
    drift: dict[str, float] = field(default_factory=dict)
    reference_note: str = ""

    @property
    def verdict(self) -> GateVerdict:
        """The first failed verdict, or the first verdict (for one-gate callers)."""
        return next((v for v in self.verdicts if not v.passed), self.verdicts[0])


def judge_one(cfg: GateConfig, metrics: Mapping[str, float], champion: Mapping[str, float] | None) -> GateVerdict:
    """One gate's verdict as flyscale's GateVerdict, whatever object the plugin returned."""
    r = cfg.plugin
    return as_gate_verdict(r.plugin.check(dict(metrics), r.options, champion), f"gate {cfg.name!r}")


def judge(
    cfg: GatesConfig | GateConfig, metrics: Mapping[str, float], champion: ChampionRef, test_sha256: str = ""
) -> Judgment:
    """Every gate, in order; the champion's test data compared with this run's and said."""
    gates = cfg.gates if isinstance(cfg, GatesConfig) else [cfg]
    match = champion.test_data(test_sha256)  # once: what the gates receive and what the summary says
    verdicts = [judge_one(g, metrics, champion.for_gate(match)) for g in gates]
    test_data = champion.split_line(test_sha256, match)
    passed = bool(verdicts) and all(v.passed for v in verdicts)
    return Judgment(verdicts, champion, passed, test_data, [f"{v.name}: {v.reason}" for v in verdicts if not v.passed])


def compares_champion(cfg: GatesConfig) -> bool:
    """Whether a configured gate compares the candidate with the champion (`compares_champion`):
    then the champion is scored on the candidate's test split first."""
    return any(bool(g.plugin.attribute("compares_champion")) for g in cfg.gates)
