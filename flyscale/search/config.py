"""What a hyperparameter search explores: a pipeline config (the base every trial starts from)
plus a `search:` section, with a space over any model, objective or training field, plugin
options included (`train.lr`, `model.options.hidden`, `train.options.bucket_cap_mb`)."""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from dataclasses import field
from typing import Any

from flyscale.config import PipelineConfig
from flyscale.config.base import Section, positive, section
from flyscale.config.strict import ConfigError

# The sections a trial may change. The data (and a table's augmented copies) is prepared once and
# shared by every trial, so fields that would change it are not searched.
SEARCHABLE = ("model", "objective", "train")
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")
METRICS = {"val_loss": "minimize", "val_accuracy": "maximize"}


@section
class Param(Section):
    """One dimension of the space: a range (`low`, `high`, optionally `log` or `step`; integers
    when both ends are), or `choices`."""

    _section = "search.space"
    low: int | float | None = None
    high: int | float | None = None
    log: bool = False
    step: int | float | None = None
    choices: list | None = None

    def __post_init__(self):
        ranged = self.low is not None or self.high is not None
        if ranged == (self.choices is not None):
            raise ValueError("search.space: give each parameter either low and high, or choices")
        if self.choices is not None:
            if not self.choices:
                raise ValueError("search.space: choices must not be empty")
            if self.log or self.step is not None:
                raise ValueError("search.space: log and step go with a range, not with choices")
            return
        if self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(f"search.space: a range needs low < high, got low={self.low}, high={self.high}")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError("search.space: a log range needs low > 0 and no step")

    @property
    def integer(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int) and not isinstance(self.step, float)


@section
class SearchConfig(Section):
    """How the search samples, prunes and how many trials it runs."""

    _section = "search"
    # Dotted config paths and their dimensions, e.g. {"train.lr": {low: 1e-4, high: 1e-1, log: true}}.
    space: dict[str, Param] = field(default_factory=dict)
    trials: int = 8
    concurrency: int = 2  # trials of a round, asked together and run side by side on a cluster
    metric: str = "val_loss"  # the validation metric a trial is judged by: val_loss or val_accuracy
    sampler: str = "tpe"  # Optuna's TPESampler, or "random"
    seed: int = 0  # the sampler's: the same study asks the same trials, which then come from the cache
    pruner: str = "median"  # Optuna's MedianPruner: stop a trial whose epoch is behind the median; or "none"
    warmup_epochs: int = 1  # epochs a trial trains before it may be pruned
    startup_trials: int = 2  # trials that finish before any is pruned
    include_base: bool = True  # the first trial is the base config itself, so the best is never worse
    name: str = ""  # the study's name ("" = the MLflow model name + "-search"): reruns of one name replay
    # Where the study lives, which every training worker must reach: the NAME of an environment
    # variable that holds an Optuna storage URL (postgresql://user:password@host/optuna). Only the
    # name travels in Flyte's inputs and outputs; the tasks that open the study read the value.
    storage_env: str = ""
    # Or the URL itself, when it holds no password (a sqlite:/// file, a database reached with a
    # .pgpass or IAM); "" with no storage_env = a SQLite file on this machine, for local runs.
    # The study is kept in MLflow either way.
    storage: str = ""

    def __post_init__(self):
        positive(self, "trials", "concurrency")
        if not self.space:
            raise ValueError("search.space is empty: name at least one field to search, e.g. train.lr")
        for path in self.space:
            if path.split(".")[0] not in SEARCHABLE:
                raise ValueError(
                    f"search.space: {path!r} is not searched: every trial shares the data prepared once, so "
                    f"the space may cover fields of {', '.join(SEARCHABLE)} (and their plugin options)"
                )
        for name, allowed in (("metric", tuple(METRICS)), ("sampler", SAMPLERS), ("pruner", PRUNERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"search.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.warmup_epochs < 0 or self.startup_trials < 0:
            raise ValueError("search.warmup_epochs and search.startup_trials must be >= 0")
        self._check_storage()

    def _check_storage(self) -> None:
        """A password never goes into the config, which travels in Flyte's literals and MLflow's params."""
        if self.storage_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.storage_env):
            raise ValueError(
                "search.storage_env must name an environment variable (OPTUNA_STORAGE), not hold a value: "
                "what it holds is no variable name (and is not repeated here: it may be a secret)"
            )
        if self.storage_env and self.storage:
            raise ValueError("search.storage and search.storage_env are both set: keep one")
        try:
            secret = urllib.parse.urlsplit(self.storage).password
        except ValueError:
            secret = None  # a URL Optuna will refuse by name when it is opened
        if secret:
            raise ValueError(
                "search.storage holds a password, and the config travels in Flyte's inputs and MLflow's params: "
                "put the URL in an environment variable (export OPTUNA_STORAGE='postgresql://...') and set "
                "search.storage_env: OPTUNA_STORAGE instead"
            )

    @property
    def direction(self) -> str:
        return METRICS[self.metric]


@section
class SearchStudyConfig(PipelineConfig):
    """A pipeline config, the base of every trial, and the search around it: a preset is any
    pipeline preset plus a `search:` section."""

    search: SearchConfig = field(default_factory=lambda: SearchConfig(space={"train.lr": Param(1e-4, 1e-1, True)}))

    def __post_init__(self):
        super().__post_init__()
        for path, param in self.search.space.items():  # every end of every range makes a valid config
            for value in param.choices if param.choices is not None else [param.low, param.high]:
                with_value(self.base(), {path: value}, f"search.space.{path}")

    def base(self) -> PipelineConfig:
        """The pipeline config every trial starts from."""
        return PipelineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PipelineConfig)})

    def study_name(self) -> str:
        return self.search.name or f"{self.mlflow.model_name}-search"


def with_value(base: PipelineConfig, values: dict[str, Any], where: str = "") -> PipelineConfig:
    """`base` with each dotted path set to its value, validated as any config is."""
    data = plain(base)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            if node.get(key) is None:  # options left empty, or a section's optional mapping
                node[key] = {}
            if not isinstance(node[key], dict):
                raise ConfigError(f"{where or path}: {key!r} is not a section or a mapping of options")
            node = node[key]
        node[leaf] = value
    try:
        return PipelineConfig.from_dict(data)
    except ConfigError as exc:
        given = ", ".join(f"{k} = {v!r}" for k, v in values.items())
        raise ConfigError(f"{where or 'search'}: {given} gives a bad config: {exc}") from None


def plain(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as the plain mapping a preset is (what `PipelineConfig.from_dict` reads)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))
