"""`PipelineConfig`: every section of one run, the workflow's only input.

Bad config stops a run here, before any data is loaded or any worker is started: every type, key,
range and plugin name, and the combinations of sections that cannot work together.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import typing
from dataclasses import field
from typing import Any

from flyscale.config import presets
from flyscale.config.base import Section, decode, section
from flyscale.config.plugins import PluginSection
from flyscale.config.publishing import (
    ExportConfig,
    GatesConfig,
    MlflowConfig,
    QuantizeConfig,
    ServingConfig,
    default_model_name,
)
from flyscale.config.sections import (
    AugmentConfig,
    DataConfig,
    ModelConfig,
    ObjectiveConfig,
    PreflightConfig,
    RecoveryConfig,
    TokenizeConfig,
    TrainConfig,
)
from flyscale.plugin.data_kind import DataKind, declared_kind
from flyscale.plugin.records import cost_name, costed


@section
class PipelineConfig(Section):
    """Everything one run of `training_pipeline` needs."""

    _what = "config section"

    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    gate: GatesConfig = field(default_factory=GatesConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """The config from a preset's mapping (YAML or JSON), strictly."""
        return decode(cls, presets.normalise(data or {}))

    @classmethod
    def merge(cls, *given: Any) -> Any:
        """Presets merged in order (`presets.merge`), each plugin section known by its name field."""
        hints = typing.get_type_hints(cls)
        names = {
            f.name: hints[f.name]._name_field
            for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], PluginSection)
        }
        return presets.merge(*given, plugin_names=names)

    @classmethod
    def from_json(cls, text: str) -> Any:
        """The workflow input `pyflyte run --cfg` builds: every `--cfg` given, merged in order."""
        given = presets.given_on_command_line()
        if len(given) > 1 and presets.read(given[-1]) == json.loads(text):  # the last is what click kept
            return cls.from_dict(cls.merge(*(presets.read(v) for v in given)))
        return cls.from_dict(json.loads(text))

    def __post_init__(self):
        if self.augment.names is None:
            # Generic config holds no plugin's defaults: the dataset says what fits its data.
            names = list(self.data.plugin.attribute("default_augmentations"))
            try:
                self.augment = dataclasses.replace(self.augment, names=names)
            except ValueError as exc:
                raise ValueError(
                    f"{exc} (augment.names is unset, so it is dataset {self.data.dataset!r}'s "
                    f"default_augmentations {names})"
                ) from None
        if not self.mlflow.model_name:
            # Named after the data, as the augmentations above: a preset that names no model
            # registers where models of its kind of data go, never under another dataset's name.
            natural = str(self.data.plugin.attribute("objective"))
            name = default_model_name(self.data.dataset, self.objective.name, natural)
            self.mlflow = dataclasses.replace(self.mlflow, model_name=name)
        asked = getattr(self.objective.plugin.options, "max_new_tokens", None)
        if isinstance(asked, int) and asked > self.serving.max_new_tokens:  # the served model's default request
            raise ValueError(
                f"objective.options.max_new_tokens {asked} exceeds serving.max_new_tokens "
                f"{self.serving.max_new_tokens}, which the served model allows a request: lower one or raise the other"
            )
        self._gates_read_what_the_objective_measures()
        if declared_kind(self.data.plugin) is DataKind.TABLE_STREAM and self.augment.names and self.augment.copies:
            # Streamed data is prepared in one pass with no augment stage: say so rather than ignore it.
            raise ValueError(
                f"augment.names: dataset {self.data.dataset!r} streams data larger than memory, which is not "
                f"augmented (copies would multiply it); set augment.names: [] or use its in-memory twin"
            )

    def _gates_read_what_the_objective_measures(self) -> None:
        """A gate that bounds a metric the objective never records would fail every run at the end
        ("no accuracy was recorded"): refuse it here, naming what the objective does record."""
        objective = self.objective.plugin.plugin
        known = measured(objective)
        for gate in self.gate.gates:
            reads = getattr(gate.plugin.plugin, "reads", None)
            for metric in reads(gate.plugin.options) if reads is not None else ():
                if fnmatch.fnmatchcase(metric, SERVED):
                    if not self.serving.loadtest:
                        raise ValueError(
                            f"gate {gate.name!r} reads {metric!r}, which only the load test of the served model "
                            f"records: set serving.loadtest: true (and serving.levels to include the concurrency read)"
                        )
                    clients = int(metric.split("_")[1].removeprefix("c"))
                    if clients not in self.serving.levels:
                        raise ValueError(
                            f"gate {gate.name!r} reads {metric!r}, but serving.levels {self.serving.levels} does not "
                            f"load-test {clients} clients: add it, or read one of those levels"
                        )
                    continue
                if not any(fnmatch.fnmatchcase(metric, p) for p in known):
                    raise ValueError(
                        f"gate {gate.name!r} reads {metric!r}, which objective {self.objective.name!r} does not "
                        f"record; it records {', '.join([*getattr(objective, 'metrics', {}), *ALWAYS_MEASURED])}, each "
                        f"also for the int8 model (int8_<name>), and what int8 costs "
                        f"({', '.join(n for n in known if n.endswith(('_drop', '_increase')))}). Name one of them in "
                        f"the gate's options (a "
                        f"language model's: gate: [{{name: min_metric, options: {{metric: perplexity, threshold: 8}}}}, "
                        f"{{name: quantization, options: {{max_worse: {{perplexity: 0.1}}}}}}])"
                    )


# What the load test of the served model records (serving.loadtest): served_c<clients>_latency_p99_ms, ...
SERVED = "served_c*"


# What every run records beside the objective's own metrics (flyscale/evaluate: the test metrics,
# the latency comparison and quantization's own numbers).
ALWAYS_MEASURED = ("loss", "size_bytes", "latency_p50_ms_b*", "latency_p99_ms_b*", "throughput_b*")


def measured(objective: Any) -> list[str]:
    """The names (globs) the gates may read under `objective`: its metrics and the always-recorded
    ones, each also as the int8 model's (`int8_` prefix), and what int8 costs on each metric."""
    ups = getattr(objective, "metrics", {}) or {}
    names = [*ups, *ALWAYS_MEASURED]
    classifier = "accuracy" in ups
    costs = ["int8_accuracy_drop"] if classifier else [f"int8_{cost_name(m, up)}" for m, up in costed(ups).items()]
    return [*names, *(f"int8_{n}" for n in names), *costs, "int8_speedup_b*", "int8_size_ratio", "onnx_max_abs_diff"]


presets.refuse_missing_files()  # as pyflyte loads a workflow: before flytekit reads the last --cfg
