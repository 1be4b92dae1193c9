"""Registration stage: one MLflow run per pipeline execution, with both models. The workflow
branches on the gates: `register_model` when every gate passed (versions registered, the alias
moved by compare-and-set), `record_candidate` when one failed (the run and its models logged,
no version). Both are one body with one signature. Then the summary of what this execution
computed and what it took from the cache."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from flytekit import task
from flytekit.types.error import FlyteError

from flyscale.config import PipelineConfig, effective, flatten
from flyscale.evaluate.gating import Judgment
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.provenance import UNSTAMPED, CacheReport, TaskRun, execution_key, stamped
from flyscale.render.summary import RunSummary
from flyscale.tracking.candidate import ALWAYS_RUN, Candidate, register
from flyscale.tracking.live import close_failed_runs
from flyscale.tracking.store import tracking_uri
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import TrainHistory
from tasks.common import SMALL, TASK, TRACKED
from tasks.records import EvaluatedModel, ExportedModel, ModelBundle, QuantizedModel, ServedModel, ValidatedData


class Registered(NamedTuple):
    summary: RunSummary
    run: TaskRun = UNSTAMPED  # filled in by @stamped


# The MLflow store is part of the version: the same inputs sent to another store register again.
# The stamps of earlier tasks only describe this execution, so they are not part of the key.
REGISTER_CACHE = code_cache(
    "models",
    "quantizers",
    "objectives",
    facts={"mlflow_store": tracking_uri},
    libraries=(*LIBRARIES, "mlflow"),
    ignored_inputs=("runs", "data_runs", "started"),
)


def _publisher(name: str, publish: bool, doc: str):
    """The register task called `name`: `publish` registers versions and moves the alias."""

    def body(
        cfg: PipelineConfig,
        validated: ValidatedData,
        preflight: PreflightReport,
        model: ModelBundle,
        history: TrainHistory,
        fp32: EvaluatedModel,
        int8: QuantizedModel,
        exported: ExportedModel,
        served: ServedModel,
        judgment: Judgment,
        runs: list[TaskRun],
        data_runs: list[TaskRun],
        started: TaskRun,
    ) -> Registered:
        candidate = Candidate(
            cfg=cfg,
            info=validated.info,
            fingerprint=validated.content,
            report=validated.report,
            quarantine_dir=validated.quarantined.dir.download(),
            profile=validated.profile,
            report_dir=validated.report_files.download(),
            history=history,
            preflight=preflight,
            weights_path=model.weights.download(),
            fp32=fp32.metrics,
            test_sha256=fp32.test_sha256,
            judgment=judgment,
            int8_weights_path=int8.weights.download(),
            int8_format=int8.format,
            int8_quantizer=int8.quantizer,
            int8=int8.metrics,
            comparison=int8.comparison,
            onnx_path=exported.onnx.download() if exported.format == "onnx" and exported.exported else "",
            onnx_sha256=exported.sha256,
            onnx_parity=exported.parity,
            onnx_max_abs_diff=exported.max_abs_diff,
            served_setup=served.setup,
            served_levels=[dataclasses.asdict(lv) for lv in served.levels],
            served_metrics=served.scalars(),
            served_plots_dir=served.plots.download() if served.setup else "",
            plots_dir=int8.plots.download(),
            runs=[*data_runs, *runs],
            started=started,
            tokens=validated.tokens,
            tokenizer_json=model.tokenizer_json(),
            trained_model=model.model,
        )
        return Registered(summary=RunSummary.of(candidate, register(candidate, publish)))

    body.__name__ = body.__qualname__ = name  # the task's name: tasks.register.register_model
    body.__doc__ = doc
    return task(cache=REGISTER_CACHE, **TRACKED, requests=SMALL)(stamped(body))


register_model = _publisher(
    "register_model", True, "Every gate passed: log the run, register both models, move the alias (compare-and-set)."
)
record_candidate = _publisher(
    "record_candidate", False, "A gate failed: log the run and both models (LoggedModels), register no version."
)


@task(cache=False, **TASK, requests=SMALL)
def summarize(
    summary: RunSummary, runs: list[TaskRun], data_runs: list[TaskRun], register_run: TaskRun, started: TaskRun
) -> RunSummary:
    """The run summary, with which tasks this execution ran and which it took from the cache."""
    summary.cache = CacheReport.of([*data_runs, *runs, register_run], started.started_at, ALWAYS_RUN)
    return summary


@task(cache=False, **TRACKED, requests=SMALL)
def close_failed_run(cfg: PipelineConfig, err: FlyteError | None = None) -> None:
    """The workflow's failure handler: the MLflow run this execution left RUNNING ends FAILED,
    with the error beside it. (Flyte runs it with the workflow's inputs when any task fails.)"""
    message = err.message if err is not None else "the execution failed"
    where = f" (in {err.failed_node_id})" if err is not None and err.failed_node_id else ""
    close_failed_runs(cfg.mlflow, execution_key(), message + where, flatten(cfg), effective(cfg))
