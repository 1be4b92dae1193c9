"""The summary of `prepare_data`, the workflow that prepares a dataset without training on it:
what came in, what was quarantined and why, the splits, and for text how it was tokenized."""

from __future__ import annotations

from dataclasses import dataclass

from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.flyte.provenance import CacheReport
from flyscale.plugin.records import DatasetInfo
from flyscale.render.summary import _counted, quarantine_reasons


@dataclass
class DataSummary:
    """What one data preparation did, in the numbers a person checks first."""

    dataset: str
    info: DatasetInfo
    validation: ValidationReport
    fingerprint: DataFingerprint
    splits: dict[str, int]  # examples (for text: packed sequences) per split
    where: dict[str, str]  # split (and "quarantine", "report") -> its directory
    tokens: TokenStats | None = None
    cache: CacheReport | None = None

    def __str__(self) -> str:
        v = self.validation
        fields = ", ".join(str(f) for f in self.info.fields) or f"{len(self.info.feature_columns)} feature columns"
        lines = [
            "",
            "flyscale data summary",
            f"  dataset     {self.dataset}: {fields}",
            f"  data        {v.total_rows} examples: {v.valid_rows} valid, {v.quarantined_rows} quarantined"
            + (f" ({quarantine_reasons(v.checks)})" if v.checks else ""),
            f"  fingerprint {self.fingerprint.value[:16]} ({self.fingerprint.method})",
        ]
        if v.drift:
            worst = max(v.drift, key=lambda k: v.drift[k])
            lines.append(f"  drift       max PSI {v.drift[worst]:.3f} ({worst}) against {v.reference}")
        what = "sequences" if self.tokens is not None else "examples"
        lines.append("  splits      " + ", ".join(f"{name} {rows} {what}" for name, rows in self.splits.items()))
        if self.tokens is not None:
            lines += self.tokens.lines()
        lines += [f"  {name:<11} {path}" for name, path in self.where.items()]
        if self.cache is not None:
            lines.append(f"  cache       ran {_counted(self.cache.ran)}; from the cache: {_counted(self.cache.cached)}")
        return "\n".join(lines)
