"""`PipelineConfig`: every section of one run, the workflow's only input.

Bad config stops a run here, before any data is loaded or any worker is started: every type, key,
range and plugin name, and the combinations of sections that cannot work together.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import field
from typing import Any

from flyscale.config import presets
from flyscale.config.base import Section, decode, section
from flyscale.config.plugins import PluginSection
from flyscale.config.publishing import GatesConfig, MlflowConfig, QuantizeConfig
from flyscale.config.sections import (
    AugmentConfig,
    DataConfig,
    ModelConfig,
    PreflightConfig,
    RecoveryConfig,
    TokenizeConfig,
    TrainConfig,
)


@section
class PipelineConfig(Section):
    """Everything one run of `training_pipeline` needs."""

    _what = "config section"

    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    gate: GatesConfig = field(default_factory=GatesConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
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
        if self.data.plugin.attribute("streaming") and self.augment.names and self.augment.copies:
            # Streamed data is prepared in one pass with no augment stage: say so rather than ignore it.
            raise ValueError(
                f"augment.names: dataset {self.data.dataset!r} streams data larger than memory, which is not "
                f"augmented (copies would multiply it); set augment.names: [] or use its in-memory twin"
            )
