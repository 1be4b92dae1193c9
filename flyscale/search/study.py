"""The study, through Optuna: a sampler asks for each round's trials, each trial's training
reports its validation metric per epoch and is pruned when it falls behind, and the finished
trials are told back. Nothing here runs training: the search's tasks do (tasks/search.py)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyscale.config.flatten import effective
from flyscale.search.config import Param, SearchConfig, SearchStudyConfig, with_value
from flyscale.train.telemetry import EpochMetrics, TrainHistory

log = logging.getLogger(__name__)

PRUNED = "pruned"


@dataclass
class TrialSpec:
    """One trial, as its training task gets it: where to report each epoch (the study's storage,
    as a password-free URL or the name of the variable that holds it, and the trial's id), how
    pruning decides, the MLflow run the trial's run is a child of, and the values it was asked to
    try, by config path, each as JSON text."""

    storage: str = ""
    storage_env: str = ""  # the variable holding the storage URL, read where the study is opened
    study: str = ""
    number: int = -1
    trial_id: int = -1
    metric: str = "val_loss"
    pruner: str = "none"
    warmup_epochs: int = 1
    startup_trials: int = 2
    parent_run_id: str = ""
    params: dict[str, str] = field(default_factory=dict)

    def key(self) -> str:
        """What the trial adds to training's cache key: a trial that can be pruned may end early, so
        it is its study's (name without the execution) trial n, never a plain run's result."""
        if self.study and self.pruner != "none":
            return f"{self.study.rsplit('@', 1)[0]}#{self.number}"
        return ""

    def run_name(self) -> str:
        """The trial's MLflow run name (see `run_name`)."""
        return run_name(self.number, self.params)


@dataclass
class TrialResult:
    number: int
    params: dict[str, str]  # as in TrialSpec: JSON text by config path
    state: str  # "complete" or "pruned"
    value: float  # the metric of the model the trial hands on (its kept epoch's, or its last)
    epochs: int
    run_id: str  # the trial's MLflow run
    replayed: bool = False  # its training came from the cache: this execution trained nothing for it
    seconds: float = 0.0  # its epochs' training time (what a search costs beyond it is overhead)
    stopping: str = ""


def run_name(number: int, params: dict[str, str]) -> str:
    """`trial-03 lr=0.00312 hidden=[128,64]`: a trial's MLflow run name, its number and the values it
    tried, each by the last part of its config path (the whole path where two end alike), so the
    UI's run list and compare view tell the trials apart."""
    leaves = [path.rsplit(".", 1)[-1] for path in params]
    values = []
    for path, leaf in zip(params, leaves):
        label = leaf if leaves.count(leaf) == 1 else path
        values.append(f"{label}={_short(json.loads(params[path]))}")
    return " ".join([f"trial-{number:02d}", *values])[:RUN_NAME_CHARS]


RUN_NAME_CHARS = 250  # MLflow keeps run names this long; a space of many long choices is cut


def _short(value: Any) -> str:
    """A value as a run name shows it: floats to 3 significant digits, lists without spaces."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def storage_url(cfg: SearchConfig, home: Path, local: bool = True) -> str:
    """The storage every trial reports to, as it may travel between tasks: the configured
    password-free URL, "" when `storage_env` names the variable that holds it, or (`local` runs
    only) a SQLite file under `home`."""
    if cfg.storage or cfg.storage_env:
        return cfg.storage
    if not local:
        raise ValueError(
            "search.storage_env is not set, and on a cluster each trial trains in a pod of its own, which cannot "
            "reach a SQLite file in this one: export an Optuna storage URL every pod reaches "
            "(OPTUNA_STORAGE=postgresql://user:password@host/optuna, from a Secret on a cluster) and set "
            "search.storage_env: OPTUNA_STORAGE"
        )
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'studies.db'}"


def opened(storage: str, storage_env: str) -> str:
    """The storage URL to open: the value of the variable `storage_env` names, else `storage`."""
    if not storage_env:
        return storage
    value = os.environ.get(storage_env, "")
    if not value:
        raise ValueError(
            f"search.storage_env names {storage_env}, which is not set in this task's environment: export it "
            f"(locally), or add it to the Secret the task pods read (docs/experiments.md)"
        )
    return value


def create(cfg: SearchStudyConfig, study: str, storage: str) -> None:
    """A fresh study, with the base config enqueued as its first trial where the space allows."""
    import optuna

    made = optuna.create_study(
        study_name=study,
        storage=opened(storage, cfg.search.storage_env),
        direction=cfg.search.direction,
        sampler=sampler(cfg.search),
    )
    if cfg.search.include_base:
        base = _base_values(cfg)
        if base:
            made.enqueue_trial(base)


def load(
    study: str, storage: str, storage_env: str, search: SearchConfig | None = None, spec: TrialSpec | None = None
) -> Any:
    """The study from its storage (`opened`), with the search's sampler or the trial's pruner."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    chosen = pruner(spec.pruner, spec.warmup_epochs, spec.startup_trials) if spec is not None else None
    return optuna.load_study(
        study_name=study,
        storage=opened(storage, storage_env),
        sampler=sampler(search) if search is not None else None,
        pruner=chosen,
    )


def sampler(cfg: SearchConfig, offset: int = 0) -> Any:
    import optuna

    seed = cfg.seed * 100_003 + offset  # distinct for every (seed, trials asked so far)
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(4, cfg.trials))


def pruner(name: str, warmup_epochs: int, startup_trials: int) -> Any:
    import optuna

    if name == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_epochs)


def distributions(space: dict[str, Param]) -> dict[str, Any]:
    """Optuna's distribution for each path. Choices are offered as their JSON text, which Optuna
    can store whatever the value is (a list of widths), and the trial decodes."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for path, p in space.items():
        if p.choices is not None:
            out[path] = CategoricalDistribution([json.dumps(c) for c in p.choices])
        elif p.integer:
            out[path] = IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))  # type: ignore[arg-type]
        else:
            out[path] = FloatDistribution(float(p.low), float(p.high), log=p.log, step=p.step)  # type: ignore[arg-type]
    return out


def ask(cfg: SearchStudyConfig, study: str, storage: str, count: int, parent_run_id: str) -> list[TrialSpec]:
    """The next `count` trials of the study (fewer when the study has asked for all it may)."""
    import optuna

    made = load(study, storage, cfg.search.storage_env)
    # An enqueued trial (the base config) waits to be asked: it is not asked yet.
    asked = sum(t.state != optuna.trial.TrialState.WAITING for t in made.get_trials(deepcopy=False))
    # Each round is a new process with a new sampler: seeded by where the study stands, so that a
    # round does not draw what the last one drew, and a rerun draws what this one did.
    made.sampler = sampler(cfg.search, asked)
    out = []
    for _ in range(max(0, min(count, cfg.search.trials - asked))):
        trial = made.ask(fixed_distributions=distributions(cfg.search.space))
        out.append(
            TrialSpec(
                storage=storage,
                storage_env=cfg.search.storage_env,
                study=study,
                number=trial.number,
                trial_id=trial._trial_id,
                metric=cfg.search.metric,
                pruner=cfg.search.pruner,
                warmup_epochs=cfg.search.warmup_epochs,
                startup_trials=cfg.search.startup_trials,
                parent_run_id=parent_run_id,
                params={k: _as_json(cfg.search.space[k], v) for k, v in trial.params.items()},
            )
        )
    return out


def trial_config(cfg: SearchStudyConfig, spec: TrialSpec) -> Any:
    """The pipeline config a trial trains: the base with the trial's values."""
    return with_value(cfg.base(), decoded(spec.params), f"trial {spec.number}")


def decoded(params: dict[str, str]) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in params.items()}


def reporter(spec: TrialSpec) -> Callable[[EpochMetrics], str]:
    """For the trial's training (rank 0): report each epoch's metric to the study, and say why to
    stop ("" to go on) when the pruner finds the trial behind the others at that epoch."""
    import optuna

    study = load(spec.study, spec.storage, spec.storage_env, spec=spec)
    trial = optuna.trial.Trial(study, spec.trial_id)

    def report(m: EpochMetrics) -> str:
        value = float(getattr(m, spec.metric))
        trial.report(value, m.epoch)
        if trial.should_prune():
            return (
                f"pruned by the search after epoch {m.epoch + 1}: {spec.metric} {value:.4f} is behind the median "
                f"of the earlier trials at that epoch"
            )
        return ""

    return report


def value(history: TrainHistory, metric: str) -> float:
    """The metric of the model a training hands on: its kept epoch's (early stopping), or its last's."""
    if not history.epochs:
        return math.nan
    epoch = history.epochs[history.kept_epoch - 1] if history.kept_epoch else history.epochs[-1]
    return float(getattr(epoch, metric))


def tell(study: Any, spec: TrialSpec, history: TrainHistory, replayed: bool) -> TrialResult:
    """Tell the study how the trial ended. A trial whose training came from the cache reported
    nothing this time: its epochs are reported first, so the pruner sees them as before."""
    import optuna

    frozen = study._storage.get_trial(spec.trial_id)
    trial = optuna.trial.Trial(study, spec.trial_id)
    for m in history.epochs:
        if m.epoch not in frozen.intermediate_values:
            trial.report(float(getattr(m, spec.metric)), m.epoch)
    result = value(history, spec.metric)
    pruned = history.stopping.startswith("pruned")
    if pruned:
        study.tell(spec.number, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(spec.number, result)
    return TrialResult(
        number=spec.number,
        params=spec.params,
        state=PRUNED if pruned else "complete",
        value=result,
        epochs=len(history.epochs),
        run_id=history.mlflow_run_id,
        replayed=replayed,
        stopping=history.stopping,
        seconds=sum(m.seconds for m in history.epochs),
    )


def best(results: list[TrialResult], direction: str) -> TrialResult:
    """The best finished trial (a pruned one never is); ValueError when every trial was pruned."""
    finished = [r for r in results if r.state != PRUNED and math.isfinite(r.value)]
    if not finished:
        raise ValueError(
            "every trial of the search was pruned or failed to give a metric: lower search.warmup_epochs's "
            "aggression (raise it), or switch search.pruner to none"
        )
    pick = min if direction == "minimize" else max
    return pick(finished, key=lambda r: (r.value, r.number))


def _base_values(cfg: SearchStudyConfig) -> dict[str, Any]:
    """The base config's value of each searched path that the space holds (a plugin option the
    preset leaves out has the plugin's default)."""
    data = json.loads(json.dumps(effective(cfg.base())))
    out: dict[str, Any] = {}
    for path, p in cfg.search.space.items():
        node: Any = data
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        if p.choices is not None:
            if node in p.choices:
                out[path] = json.dumps(node)
        elif p.low <= node <= p.high:
            out[path] = node
    return out


def _as_json(p: Param, v: Any) -> str:
    """A value Optuna gave, as JSON text: a choice already is."""
    return v if p.choices is not None else json.dumps(v)
