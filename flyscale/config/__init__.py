"""Typed configuration: one strict section per stage, grouped in `PipelineConfig`.

What lives here, and what it may import: the sections (`sections` for data and training,
`publishing` for gates, quantization and MLflow, `pipeline` for the whole run), what they share (`base`),
strict checking and its messages (`strict`), plugin options (`plugins`, which resolves plugins
through `flyscale.plugin`), presets read and merged (`presets`) and the flat view MLflow logs
(`flatten`). Below it only `plugin`, `errors` and `settings`: every stage builds on config, never
the other way.
Importing it loads neither torch nor pandas.
"""

from flyscale.config.flatten import effective, flatten
from flyscale.config.pipeline import PipelineConfig
from flyscale.config.publishing import (
    ExportConfig,
    GateConfig,
    GatesConfig,
    MlflowConfig,
    QuantizeConfig,
    ServingConfig,
)
from flyscale.config.sections import (
    AugmentConfig,
    DataConfig,
    EarlyStoppingConfig,
    ModelConfig,
    ObjectiveConfig,
    PreflightConfig,
    RecoveryConfig,
    TokenizeConfig,
    TrainConfig,
)
from flyscale.config.strict import ConfigError

__all__ = [
    "AugmentConfig",
    "ConfigError",
    "DataConfig",
    "ExportConfig",
    "GateConfig",
    "GatesConfig",
    "MlflowConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "PipelineConfig",
    "PreflightConfig",
    "QuantizeConfig",
    "RecoveryConfig",
    "ServingConfig",
    "TokenizeConfig",
    "EarlyStoppingConfig",
    "TrainConfig",
    "effective",
    "flatten",
    "from_dict",
]


def from_dict(data: dict) -> PipelineConfig:
    """A validated PipelineConfig from a preset's mapping; wrong types and unknown keys are errors."""
    return PipelineConfig.from_dict(data)
