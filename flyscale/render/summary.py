"""The run summary: the workflow's output, printed by `pyflyte run` at the end of a local run."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.flyte.provenance import CacheReport
from flyscale.plugin.records import GateVerdict
from flyscale.tracking.candidate import Candidate, judged_report, resumed
from flyscale.tracking.log_and_register import Registration
from flyscale.train.preflight import PreflightReport

# MLflow 3.17's UI opens an experiment on the GenAI overview unless the URL (or the browser's
# last choice) says "machine learning"; this path lands on the runs table.
RUNS_VIEW = "#/experiments/{id}?workflowType=machine_learning"


def _ui_command(uri: str, experiment_id: str) -> str:
    page = RUNS_VIEW.format(id=experiment_id)
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}/{page}"
    return f".venv/bin/mlflow ui --backend-store-uri {uri} --port 5000   # then open http://127.0.0.1:5000/{page}"


SHOWN_REASONS = 5


def quarantine_reasons(checks: dict[str, int], shown: int = SHOWN_REASONS) -> str:
    """Each failed check's row count, commonest first: the first few, then how many more."""
    ranked = sorted(checks.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{name}: {rows}" for name, rows in ranked[:shown])
    rest = ranked[shown:]
    if rest:
        text += f", and {len(rest)} more check(s) on {sum(n for _, n in rest)} row(s)"
    return text


@dataclass
class RunSummary:
    """What one pipeline run did, in numbers a person checks first."""

    validation: ValidationReport
    fp32: EvalMetrics
    int8: EvalMetrics
    verdicts: list[GateVerdict]
    registration: Registration
    preflight: PreflightReport
    fingerprint: DataFingerprint
    cache: CacheReport | None = None  # filled in by the last task of each execution
    comparison: Comparison | None = None  # int8 against fp32, latency side by side
    test_data: str = ""  # the test data against the champion's
    resumed: str = ""  # where training resumed from after a restart or retry ("" = it ran through)
    started_from: str = ""  # the weights training started from (model.init_from); "" = fresh ones
    parameters: int = 0  # the model's (0: not known)
    trained_parameters: int = 0  # of those, the ones training updated
    stopping: str = ""  # what early stopping did: the epoch kept and why training stopped ("" = off)
    diagnosis: str = ""  # what held training back (input- or communication-bound) and the knob; "" = nothing
    workers: str = ""  # how many workers trained, and why that many ("" = not said)
    tokens: TokenStats | None = None  # text: the tokenizer, the token counts and the unigram baseline
    onnx: str = ""  # how the ONNX export answered the test split against PyTorch ("" = not exported)
    served: list[str] = field(default_factory=list)  # the load test of the served model, a line a level
    reference_note: str = ""  # drift measured against the champion judged against, not validation's reference

    @classmethod
    def of(cls, candidate: Candidate, registration: Registration) -> RunSummary:
        """The summary of a registered (or recorded) candidate."""
        c = candidate
        return cls(
            validation=judged_report(c.report, c.judgment),
            reference_note=c.judgment.reference_note if c.judgment.remeasured else "",
            fp32=c.fp32,
            int8=c.int8,
            verdicts=c.judgment.verdicts,
            registration=registration,
            preflight=c.preflight,
            fingerprint=c.fingerprint,
            comparison=c.comparison,
            test_data=c.judgment.test_data,
            resumed=resumed(c.history),
            stopping=c.history.stopping,
            started_from=c.history.started_from,
            parameters=c.history.parameters,
            trained_parameters=c.history.trained_parameters,
            diagnosis=c.history.diagnosis,
            workers=c.history.workers,
            tokens=c.tokens,
            onnx=c.onnx_parity,
            served=[
                f"{c.served_setup}, {r['concurrency']:>2} clients: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                f"{r['throughput']:.0f} req/s  {r['errors']} of {r['requests']} failed"
                for r in c.served_levels
            ],
        )

    def _models(self) -> list[str]:
        """The test metrics of both models: a classifier's accuracy and macro-F1, or the objective's own."""
        fp32, int8, c = self.fp32, self.int8, self.comparison
        # The sizes of the files compared and served (the ONNX export and its int8 copy, where the
        # comparison was made on ONNX), not the trained state dict against an ONNX file.
        fp32 = (
            dataclasses.replace(fp32, size_bytes=round(int8.size_bytes * c.size_ratio)) if c and c.size_ratio else fp32
        )
        ratio = f"{fp32.size_bytes / max(int8.size_bytes, 1):.2f}x smaller"
        if fp32.classifier:
            return [
                f"  fp32        test accuracy {fp32.accuracy:.4f}  macro-F1 {fp32.macro_f1:.4f}  "
                f"size {fp32.size_bytes / 1024:.1f} KiB",
                f"  int8        test accuracy {int8.accuracy:.4f}  macro-F1 {int8.macro_f1:.4f}  "
                f"size {int8.size_bytes / 1024:.1f} KiB  (drop {fp32.accuracy - int8.accuracy:+.4f}, {ratio})",
            ]
        costs = self.comparison.costs if self.comparison is not None else {}
        shown = ", ".join(f"{k.replace('_', ' ')} {v:+.4f}" for k, v in costs.items())
        lines = [
            f"  fp32        test loss {fp32.loss:.4f}  {_values(fp32)}  size {fp32.size_bytes / 1024:.1f} KiB",
            f"  int8        test loss {int8.loss:.4f}  {_values(int8)}  size {int8.size_bytes / 1024:.1f} KiB  "
            f"({shown + ', ' if shown else ''}{ratio})",
        ]
        t = self.tokens
        if t is not None and t.unigram_entropy_bits:
            bits = fp32.values.get("bits_per_token", 0.0)
            lines.append(
                f"  baseline    unigram entropy {t.unigram_entropy_bits:.3f} bits a token (training split, "
                f"{t.unigram_entropy_bits * math.log(2):.3f} nats: the unit of the loss); the model's {bits:.3f} is "
                f"{t.unigram_entropy_bits - bits:+.3f} below it"
            )
        for prompt, made in fp32.samples.items():
            lines.append(f"  sample      {prompt + made!r}")
        return lines

    def __str__(self) -> str:
        r, v = self.registration, self.validation
        lines = [
            "",
            "flyscale run summary",
            f"  data        {v.total_rows} rows: {v.valid_rows} valid, {v.quarantined_rows} quarantined"
            + (f" ({quarantine_reasons(v.checks)})" if v.checks else ""),
            *(
                [f"  quarantine  the rows and their reasons: artifacts data/quarantine/ of mlflow run {r.run_id}"]
                if v.quarantined_rows
                else []
            ),
            f"  reference   {v.reference or 'none yet (the first model of this name)'}"
            + (
                f"; drift max PSI {max(v.drift.values()):.3f} ({max(v.drift, key=lambda k: v.drift[k])})"
                if v.drift
                else ""
            ),
            *([f"              {self.reference_note}"] if self.reference_note else []),
            f"  fingerprint {self.fingerprint.value[:16]} ({self.fingerprint.method})",
            *(self.tokens.lines() if self.tokens is not None else []),
            *self._models(),
            *(
                [f"  int8        {'' if self.comparison.pays else 'not registered: it '}{self.comparison.verdict}"]
                if self.comparison is not None and self.comparison.verdict
                else []
            ),
            *(
                [
                    f"  onnx        {self.onnx}"
                    + ("" if self.onnx.startswith("not exported") else ": artifact onnx/model.onnx")
                ]
                if self.onnx
                else []
            ),
            *[f"  served      {line}" for line in self.served],
        ]
        if self.workers:
            lines.append(f"  workers     {self.workers}")
        if self.parameters:
            trained = self.trained_parameters
            lines.append(
                f"  parameters  {self.parameters:,}, all trained"
                if trained == self.parameters
                else f"  parameters  {trained:,} of {self.parameters:,} trained ({100 * trained / self.parameters:.2f}%; "
                f"the rest frozen)"
            )
        if self.resumed:
            lines.append(f"  training    {self.resumed}")
        if self.started_from:
            lines.append(f"  started     from {self.started_from}")
        if self.stopping:
            lines.append(f"  epochs      {self.stopping}")
        if self.diagnosis:
            lines.append(f"  warning     {self.diagnosis}")
        p = self.preflight
        if p.steps and p.checked:
            lines.append(
                f"  preflight   PASSED: {p.steps} steps at world size 1 vs {p.world_size}, "
                f"max relative loss difference {p.max_rel_diff:.1e} (tolerance {p.rtol:.0e})"
            )
            if p.slower_with_workers:
                lines.append(f"  warning     {p.slower_with_workers}")
        if self.comparison is not None:
            lines += [f"  latency     {line}" for line in self.comparison.lines()]
        for g in self.verdicts:
            lines.append(f"  gate        {g.name}: {'PASSED' if g.passed else 'FAILED'} ({g.reason})")
        judged = f"v{r.judged_against}" if r.judged_against else "no champion"
        champion = f"alias '{r.alias}' -> these versions" if r.champion else f"alias '{r.alias}' NOT moved"
        lines.append(f"  judged      against {judged} ('{r.alias}' when the gate ran)")
        if self.test_data:
            lines.append(f"  test data   {self.test_data}")
        lines.append(f"  mlflow      run {r.run_id} (experiment {r.experiment_id}) at {r.tracking_uri}")
        if r.run_name:
            lines.append(f"  run name    {r.run_name}")
        if r.model_version:
            again = " (this training run was registered before: no new version)" if r.reused else ""
            twin = f", {r.int8_model_name} v{r.int8_model_version}" if r.int8_model_version else " (no int8 twin)"
            lines.append(f"  registered  {r.model_name} v{r.model_version}{twin}{again}; {champion}")
        else:
            lines.append("  registered  no version: the candidate and its models are logged with the run only")
        lines.append(f"  promotion   {r.promotion}")
        if self.cache is not None:
            c = self.cache
            lines.append(f"  cache       ran {_counted(c.ran)}; from the cache: {_counted(c.cached)}")
            lines.append(
                f"              always run: {', '.join(c.always)} (they read the data and the champion as they are now)"
            )
            if "register_model" in c.cached:
                lines.append(
                    "              registration is the cached one of an earlier execution: nothing was registered again"
                )
        lines.append(f"  mlflow ui   {_ui_command(r.tracking_uri, r.experiment_id)}")
        return "\n".join(lines)


def _values(m: EvalMetrics) -> str:
    """An objective's own metrics, in its order: "perplexity 8.1234  bits per byte 2.1234 ..."."""
    return "  ".join(
        f"{k.replace('_', ' ')} {v:,.0f}" if abs(v) >= 1000 else f"{k.replace('_', ' ')} {v:.4f}"
        for k, v in m.values.items()
    )


def _counted(tasks: list[str]) -> str:
    """Task names in order, a task that ran several times (a map task's shards) once with its count."""
    counts = Counter(tasks)
    return ", ".join(f"{t} x{counts[t]}" if counts[t] > 1 else t for t in dict.fromkeys(tasks)) or "nothing"
