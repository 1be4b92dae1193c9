"""Scaling-study stages. The study is a @dynamic of ordinary cached training runs: a nested
subset of the training rows per data fraction, one training task per worker count (the training
task's own body under a launcher of that many processes), and what each point measured. Then
the report (a Deck, and an MLflow parent run with a child run per point) and the summary.

The logic (plan, subsets, fits, recommendations) is flyscale/scaling.py. What is here besides
the tasks renders a study's result: its plots, its Deck and its MLflow record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import json
import logging
import os
import tempfile
import textwrap
import time
from typing import Iterator, NamedTuple, Optional

import numpy as np
import torch
from flytekit import Deck, dynamic, task
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile
from pandera.typing import DataFrame

from flyscale import artifacts, data, scaling, shards, tracking
from flyscale.caching import LIBRARIES, code_cache
from flyscale.config import AugmentConfig, MlflowConfig, ModelConfig, RecoveryConfig, TrainConfig, flatten
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint
from flyscale.evaluation import evaluate, evaluate_batches
from flyscale.flyte_types import register
from flyscale.preflight import PreflightReport
from flyscale.provenance import TaskRun, execution_key
from flyscale.scaling import PointSpec, ScalingPoint, StudyConfig, StudySummary
from flyscale.schemas import LabeledFrame
from flyscale.shards import Shards
from flyscale.training import TrainHistory
from tasks import resources
from tasks.common import DECKS, SMALL, TASK
from tasks.elastic import LocalSafeElastic, elastic_launcher, launcher_environment, training_retries
from tasks.train import Trained, train_model

log = logging.getLogger(__name__)

register(
    StudyConfig, scaling.ScalingConfig, PointSpec, ScalingPoint, scaling.PowerLawFit, scaling.Knee, scaling.Bound,
    scaling.Efficiency, scaling.WorkerAdvice, scaling.StudyResult, StudySummary,
)

Subset = NamedTuple("Subset", [("original", Shards), ("augmented", Shards)])
NO_PREFLIGHT = PreflightReport(passed=True, world_size=0)  # a study's points skip the check: steps == 0


def worker_counts() -> list[int]:
    """The worker counts a study can sweep: FLYSCALE_SCALING_WORKERS (default 1,2,4,8), read when
    the tasks are defined, as the launcher's settings are (a task cannot change its process count
    while it runs, so every count is a task of its own)."""
    text = os.environ.get("FLYSCALE_SCALING_WORKERS") or "1,2,4,8"
    try:
        counts = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ValueError(f"FLYSCALE_SCALING_WORKERS must be worker counts >= 1 separated by commas, got {text!r}")
    return counts


def _launcher(workers: int) -> LocalSafeElastic:
    """One node of `workers` torch-elastic processes, whatever launcher the pipeline registers
    with: the study's worker count is its own, not FLYSCALE_NNODES x FLYSCALE_NPROC_PER_NODE."""
    return elastic_launcher(1, workers, int(launcher_environment()["FLYSCALE_MAX_RESTARTS"]))


def _train_point(threads: int, **inputs) -> Trained:
    """Train as train_model does, on `threads` threads per worker process."""
    # Set, never inherited: a forked worker keeps the thread count of the process that launched it,
    # which flytekit sets to 1 for every launch after the first of many workers, so what a point
    # measured would depend on the order of the points.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return train_model.task_function(preflight=NO_PREFLIGHT, **inputs)


def _training_task(workers: int):
    """The training task's body as a task of its own that always runs `workers` processes."""

    def body(train: Shards, val: Shards, info: DatasetInfo, model_cfg: ModelConfig, cfg: TrainConfig,
             fingerprint: DataFingerprint, started: TaskRun, mlflow_cfg: MlflowConfig, recovery: RecoveryConfig,
             threads: int) -> Trained:
        return _train_point(threads, train=train, val=val, info=info, model_cfg=model_cfg, cfg=cfg,
                            fingerprint=fingerprint, started=started, mlflow_cfg=mlflow_cfg, recovery=recovery)

    body.__name__ = body.__qualname__ = f"train_point_{workers}w"  # the task's name: tasks.scaling.train_point_2w
    return task(
        task_config=_launcher(workers),
        # As train_model's, with this task's own launcher. `threads` stays in the key: it sets the
        # throughput the point measures.
        cache=code_cache("models", "strategies",
                         facts={"launcher": lambda: f"elastic:nnodes=1:nproc_per_node={workers}"},
                         ignored_inputs=("fingerprint", "started", "mlflow_cfg", "recovery")),
        **TASK,
        **resources.CLUSTER.training.task_kwargs(workers),  # per worker process, times the workers
        interruptible=True, retries=training_retries(), enable_deck=True, deck_fields=DECKS,
    )(body)


TRAINING = {n: _training_task(n) for n in worker_counts()}
# Module attributes, as Flyte's resolver finds a task in its container: by module and function name.
globals().update({t.task_function.__name__: t for t in TRAINING.values()})


@task(cache=code_cache(), **TASK, requests=SMALL)
def train_rows(train: DataFrame[LabeledFrame]) -> Shards:
    """The training split as shards: what the study subsets (a frame would be uploaded afresh by
    the dynamic study, under a new name each time, and miss the cache of everything after it)."""
    return shards.write(train, "train-rows")


@task(cache=code_cache("augmentations"), **TASK, requests=SMALL)
def subset_train(train: Shards, info: DatasetInfo, augment: AugmentConfig, fraction: float, seed: int) -> Subset:
    """A nested, stratified `fraction` of the training rows, as they are and augmented."""
    frame = shards.read(train.dir.download())
    rows = frame.iloc[scaling.nested_subset(frame[info.label_column].to_numpy(), fraction, seed)]
    rows = rows.reset_index(drop=True)
    return Subset(shards.write(rows, "subset"), shards.write(data.augment(rows, info, augment), "train"))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread while the block runs.

    Locally every task runs in the one process that forks the next point's training workers, and
    GNU OpenMP is not fork-safe: a worker forked after its parent ran a multi-threaded kernel hangs
    in its own first one (in gomp_team_barrier_wait_end, for ever). One thread starts no OpenMP team.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@task(cache=code_cache("models"), **TASK, requests=SMALL)
def measure_point(spec: PointSpec, weights: FlyteFile, history: TrainHistory, trained: TaskRun, train: Shards,
                  val: Shards, info: DatasetInfo, model_cfg: ModelConfig) -> ScalingPoint:
    """A point's val and train error (eval mode, unaugmented rows), its size and its throughput."""
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), weights.download())
    rows = shards.read(train.dir.download(), [*info.feature_columns, info.label_column])
    with _one_thread():
        own = evaluate(model, *data.to_tensors(rows, info), info.num_classes)
        held_out = evaluate_batches(model, data.batches(val, info), info.num_classes)
    median, low, high = scaling.throughput([e.samples_per_s for e in history.epochs])
    return scaling.replace_point(
        spec, train_rows=train.rows, parameters=sum(p.numel() for p in model.parameters()),
        val_error=1.0 - held_out.accuracy, train_error=1.0 - own.accuracy, val_rows=val.rows,
        samples_per_s=median, samples_per_s_low=low, samples_per_s_high=high, train_seconds=trained.seconds,
        epochs=len(history.epochs), mlflow_run_id=history.mlflow_run_id, trained_at=trained.started_at,
    )


def point_execution(execution: str, spec: PointSpec) -> str:
    """Each point's own execution key. Training's live MLflow run and its checkpoint directory are
    found by it, so points never continue each other's runs or resume each other's checkpoints."""
    return f"{execution}/{spec.key}"


def study_mlflow(cfg: StudyConfig) -> MlflowConfig:
    return dataclasses.replace(cfg.mlflow, experiment=cfg.scaling.experiment)


@dynamic(**TASK, requests=SMALL)
def run_study(cfg: StudyConfig, train: Shards, val: Shards, info: DatasetInfo, fingerprint: DataFingerprint,
              started: TaskRun) -> list[ScalingPoint]:
    """Every point of the plan as an ordinary cached training run, and what it measured."""
    specs = scaling.plan(cfg.scaling)
    missing = sorted({s.workers for s in specs} - set(TRAINING))
    if missing:
        raise ValueError(f"scaling.workers: no training task for {missing} worker(s); these tasks have "
                         f"{sorted(TRAINING)}: set FLYSCALE_SCALING_WORKERS to the counts, comma separated")
    subsets = {f: subset_train(train=train, info=info, augment=cfg.augment, fraction=f, seed=cfg.scaling.seed)
               for f in sorted({s.data_fraction for s in specs})}
    points = []
    for spec in specs:
        original, augmented = subsets[spec.data_fraction]
        model_cfg = scaling.spec_model(cfg.model, spec)
        stamp = dataclasses.replace(started, execution=point_execution(started.execution, spec))
        weights, history, ran = TRAINING[spec.workers](
            train=augmented, val=val, info=info, model_cfg=model_cfg, cfg=cfg.train, fingerprint=fingerprint,
            started=stamp, mlflow_cfg=study_mlflow(cfg), recovery=cfg.recovery, threads=cfg.scaling.threads_per_worker,
        )
        points.append(measure_point(spec=spec, weights=weights, history=history, trained=ran, train=original,
                                    val=val, info=info, model_cfg=model_cfg))
    return points


# Cached like registration: the same points sent to the same store are logged once.
@task(cache=code_cache(facts={"mlflow_store": tracking.tracking_uri}, libraries=(*LIBRARIES, "mlflow", "matplotlib"),
                       ignored_inputs=("started",)),
      **TASK, requests=SMALL, enable_deck=True, deck_fields=DECKS)
def report_study(cfg: StudyConfig, points: list[ScalingPoint], started: TaskRun) -> StudySummary:
    """Fits and recommendations; the "Scaling study" Deck; one MLflow parent run, a child per point."""
    result = scaling.analyse(points, cfg.scaling)
    with tempfile.TemporaryDirectory() as tmp:
        figures = plot_study(result, cfg.scaling, tmp)
        Deck("Scaling study", html_page(result, figures))
        summary = log_study(cfg, study_mlflow(cfg), result, figures, started)
    for line in result.lines():
        log.info("%s", line)
    return summary


@task(cache=False, **TASK, requests=SMALL)
def summarize_study(summary: StudySummary, started: TaskRun) -> StudySummary:
    """The summary, with which points this execution trained and which came from the cache."""
    fresh = {p.key for p in summary.result.points if p.trained_at >= started.started_at}
    summary.trained = sorted(fresh)
    summary.cached = sorted(p.key for p in summary.result.points if p.key not in fresh)
    return summary


@task(cache=False, **TASK, requests=SMALL)
def close_failed_study(cfg: StudyConfig, err: Optional[FlyteError] = None) -> None:
    """The workflow's failure handler: the points' live MLflow runs this execution left RUNNING
    end FAILED, with the error beside them."""
    message = err.message if err is not None else "the execution failed"
    for spec in scaling.plan(cfg.scaling):
        tracking.close_failed_runs(study_mlflow(cfg), point_execution(execution_key(), spec), message)


# ---------------------------------------------------------------------------------------------
# Rendering a study's result: its plots, its Deck and its MLflow record

FLOOR = 1e-4  # a zero error on log axes: drawn here, at the bottom


def _figure(**kwargs):
    # Without pyplot, as flyscale/plots.py: a bare Figure on an Agg canvas holds no global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _nothing(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _error_curve(ax, result: scaling.StudyResult, axis: str) -> None:
    """Val error against training rows or parameters, log-log, with the fit, its doubling and the knee."""
    fit, knee = (result.data_fit, result.data_knee) if axis == "data" else (result.model_fit, result.model_knee)
    noun = "training rows" if axis == "data" else "parameters"
    ax.set_title(f"validation error vs {noun}", fontsize=10)
    points = scaling.on_axis(result.points, axis)
    if len(points) < 2:
        return _nothing(ax, f"the {axis} axis was not swept")
    x = np.array([scaling.size_of(p, axis) for p in points])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.plot(x, np.maximum([p.val_error for p in points], FLOOR), "o", color="C0", label="measured")
    if fit.meaningful:
        inside, beyond = np.geomspace(x.min(), fit.largest, 100), np.geomspace(fit.largest, 2 * fit.largest, 20)
        ax.plot(inside, fit.predict(inside), "-", color="C1",
                label=f"fit: beta {fit.beta:.2f}, gamma {fit.gamma:.4f}, R^2 {fit.r2_log:.2f}")
        ax.plot(beyond, fit.predict(beyond), "--", color="C1")
        doubled = float(fit.predict(fit.largest)) - fit.drop
        ax.errorbar([2 * fit.largest], [doubled], yerr=[[fit.drop_high - fit.drop], [fit.drop - fit.drop_low]],
                    fmt="s", color="C1", capsize=3,
                    label=f"doubled: -{fit.drop:.4f} (90%: {fit.drop_low:.4f}-{fit.drop_high:.4f})")
        if fit.gamma > 0:
            ax.axhline(fit.gamma, ls=":", color="grey", label="gamma: irreducible error")
    else:
        ax.text(0.03, 0.03, textwrap.fill(f"no fit: {fit.reason}", 55), transform=ax.transAxes, fontsize=7)
    if knee.found:
        ax.axvline(knee.size, ls="--", lw=1, color="C2", label=f"knee: {knee.size:,.0f}")
    ax.set_xlabel(noun)
    ax.set_ylabel("validation error")
    ax.legend(fontsize=7, loc="upper right")


def _workers(axes, result: scaling.StudyResult) -> None:
    """Throughput, speed-up and parallel efficiency against workers, as measured."""
    advice = result.workers
    titles = ("throughput", "speed-up", "parallel efficiency")
    for ax, title in zip(axes, titles):
        ax.set_title(f"{title} vs workers", fontsize=10)
    if not advice.measured:
        for ax in axes:
            _nothing(ax, "fewer than 2 worker counts")
        return
    n = [r.workers for r in advice.table]
    axes[0].plot(n, [r.samples_per_s for r in advice.table], "o-")
    axes[0].set_ylabel("training samples/s")
    axes[1].plot(n, [r.speedup for r in advice.table], "o-", label="measured")
    axes[1].plot(n, [w / n[0] for w in n], ":", color="grey", label="linear")
    spread = [[r.efficiency - r.low for r in advice.table], [r.high - r.efficiency for r in advice.table]]
    axes[2].errorbar(n, [r.efficiency for r in advice.table], yerr=spread, fmt="o-", capsize=3,
                     label="measured (epochs' quartiles)")
    axes[2].axhline(advice.threshold, ls="--", color="C3", label=f"min_efficiency {advice.threshold:g}")
    axes[2].set_ylim(0, max(1.1, *(r.high + 0.1 for r in advice.table)))
    for ax in axes:
        ax.set_xticks(n)
        ax.set_xlabel("workers")
        ax.axvline(advice.workers, lw=6, alpha=0.15, color="C2")  # the recommended count
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)


def _label(p: ScalingPoint) -> str:
    return f"data {p.data_fraction:g}, width {p.width_multiplier:g}, depth {p.depth_multiplier:g}, {p.workers}w"


def _gap(ax, result: scaling.StudyResult, max_gap: float) -> None:
    """Train minus val accuracy per point: over-fitting."""
    points = sorted(result.points, key=lambda p: p.key)
    rows = np.arange(len(points))
    ax.barh(rows, [p.gap for p in points], color=["C3" if p.gap > max_gap else "C0" for p in points])
    ax.axvline(max_gap, ls="--", color="C3", label=f"max_gap {max_gap:g}")
    ax.set_yticks(rows, [_label(p) for p in points], fontsize=7)
    ax.set_xlabel("train accuracy - val accuracy")
    ax.set_title("train/validation gap per point", fontsize=10)
    ax.legend(fontsize=7)


def plot_study(result: scaling.StudyResult, cfg: scaling.ScalingConfig, folder: str) -> dict[str, str]:
    """{file name: path} of the study's plots: one overview and each view on its own."""
    out = {}
    overview = _figure(figsize=(15, 8.5))
    grid = overview.subplots(2, 3)
    _error_curve(grid[0][0], result, "data")
    _error_curve(grid[0][1], result, "model")
    _gap(grid[0][2], result, cfg.max_gap)
    _workers(grid[1], result)
    parts = {"scaling.png": overview}
    for name, axis in (("error_vs_data.png", "data"), ("error_vs_parameters.png", "model")):
        parts[name] = _figure(figsize=(6, 4.5))
        _error_curve(parts[name].subplots(), result, axis)
    parts["workers.png"] = _figure(figsize=(13, 4))
    _workers(parts["workers.png"].subplots(1, 3), result)
    parts["gap.png"] = _figure(figsize=(7, 1.5 + 0.35 * len(result.points)))
    _gap(parts["gap.png"].subplots(), result, cfg.max_gap)
    for name, fig in parts.items():
        fig.tight_layout()
        out[name] = os.path.join(folder, name)
        fig.savefig(out[name], dpi=80)
    return out


def _png(path: str) -> str:
    import base64

    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode("ascii")


def html_page(result: scaling.StudyResult, figures: dict[str, str]) -> str:
    """The "Scaling study" Deck: the recommendations with their numbers, the plots, every point."""
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in result.lines())
    rows = "".join(
        f"<tr><td>{html.escape(p.key)}</td><td>{p.train_rows:,}</td><td>{p.parameters:,}</td><td>{p.workers}</td>"
        f"<td>{p.val_error:.4f}</td><td>{p.train_error:.4f}</td><td>{p.gap:+.4f}</td>"
        f"<td>{p.samples_per_s:,.0f}</td></tr>"
        for p in sorted(result.points, key=lambda p: p.key)
    )
    return (
        f"<h3>Scaling study</h3><ul>{lines}</ul>"
        f'<img alt="scaling study" src="data:image/png;base64,{_png(figures["scaling.png"])}"/>'
        "<table><thead><tr><th>point</th><th>training rows</th><th>parameters</th><th>workers</th><th>val error</th>"
        f"<th>train error</th><th>gap</th><th>samples/s</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _batches(items: list, size: int = 100):
    """MLflow takes at most 100 params (and 1000 metrics) a request."""
    return [items[i: i + size] for i in range(0, len(items), size)]


def _point_values(p: ScalingPoint) -> tuple[dict[str, float], dict[str, str]]:
    # Named apart from the epoch curves training logged to the same run (val_accuracy, samples_per_s).
    metrics = {"point_val_error": p.val_error, "point_train_error": p.train_error, "point_train_val_gap": p.gap,
               "point_parameters": p.parameters, "point_train_rows": p.train_rows,
               "point_samples_per_s": p.samples_per_s, "point_train_seconds": p.train_seconds}
    params = {"data_fraction": p.data_fraction, "width_multiplier": p.width_multiplier,
              "depth_multiplier": p.depth_multiplier, "workers": p.workers, "axes": ",".join(p.axes),
              "epochs": p.epochs}
    return metrics, {k: str(v) for k, v in params.items()}


def _log_point(client, experiment: str, parent: str, p: ScalingPoint, started: TaskRun) -> str:
    """A point as a child run of the study: the live run its training opened when this execution
    trained it (its epoch curves are there), else a new run that names the run it was trained in."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException

    metrics, params = _point_values(p)
    run = None
    if p.mlflow_run_id:
        try:
            run = client.get_run(p.mlflow_run_id)
        except MlflowException:
            run = None
    # RUNNING: trained in this execution. Finished: a cached point, already a child of an earlier study.
    adopt = run is not None and run.info.status == "RUNNING" and run.info.experiment_id == experiment
    tags = {"mlflow.parentRunId": parent, "flyscale.scaling.point": p.key,
            "flyscale.scaling.trained": "in this execution" if adopt else f"cached: trained in run {p.mlflow_run_id}"}
    if adopt:
        run_id = run.info.run_id
        client.update_run(run_id, name=p.key)
    else:
        run_id = client.create_run(experiment, start_time=int(started.started_at * 1000), run_name=p.key,
                                   tags={tracking.EXECUTION_TAG: started.execution}).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                     params=[Param(k, v) for k, v in params.items()], tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _study_metrics(result: scaling.StudyResult) -> dict[str, float]:
    out: dict[str, float] = {"recommended_workers": result.workers.workers, "train_val_gap": result.bound.gap}
    for name, fit in (("data", result.data_fit), ("parameters", result.model_fit)):
        if fit.meaningful:
            out |= {f"{name}_fit_beta": fit.beta, f"{name}_fit_gamma": fit.gamma, f"{name}_fit_r2_log": fit.r2_log,
                    f"{name}_doubling_drop": fit.drop, f"{name}_doubling_drop_low": fit.drop_low,
                    f"{name}_doubling_drop_high": fit.drop_high}
    for name, knee in (("data_knee_rows", result.data_knee), ("model_knee_parameters", result.model_knee)):
        if knee.found:
            out[name] = knee.size
    return out


def log_study(cfg: StudyConfig, store: MlflowConfig, result: scaling.StudyResult, figures: dict[str, str],
              started: TaskRun) -> StudySummary:
    """One parent run (config, fits, recommendations, plots, the points table) and a child per point."""
    import pandas as pd
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    with tracking.client_settings(store):
        uri = tracking.tracking_uri()
        client = MlflowClient(uri)
        experiment = tracking.use_experiment(client, store.experiment)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started.started_at))
        name = f"scaling-{cfg.model.name}-{cfg.data.dataset}-{stamp}"
        parent = client.create_run(experiment, start_time=int(started.started_at * 1000), run_name=name,
                                   tags={tracking.EXECUTION_TAG: started.execution, "flyscale.scaling": "study"})
        parent = parent.info.run_id
        try:
            params = [Param(k, str(v)[: tracking.MAX_PARAM_CHARS]) for k, v in flatten(cfg).items()]
            tags = {"flyscale.scaling.bound": result.bound.verdict, "flyscale.scaling.workers": result.workers.sentence,
                    "flyscale.scaling.data_fit": result.data_fit.summary(),
                    "flyscale.scaling.parameters_fit": result.model_fit.summary()}
            now = int(time.time() * 1000)
            client.log_batch(parent, metrics=[Metric(k, float(v), now, 0) for k, v in _study_metrics(result).items()],
                             tags=[RunTag(k, v) for k, v in tags.items()])
            for chunk in _batches(params):
                client.log_batch(parent, params=chunk)
            for path in figures.values():
                client.log_artifact(parent, path, "plots")
            client.log_text(parent, "\n".join(result.lines()) + "\n", "recommendations.txt")
            client.log_text(parent, json.dumps(dataclasses.asdict(result), indent=1, default=float), "study.json")
            client.log_table(parent, pd.DataFrame([dataclasses.asdict(p) | {"gap": p.gap} for p in result.points]),
                             "points.json")
            for point in result.points:
                _log_point(client, experiment, parent, point, started)
        except BaseException:
            client.set_terminated(parent, "FAILED")
            raise
        client.set_terminated(parent, "FINISHED")
    return StudySummary(result, uri, experiment, parent)
