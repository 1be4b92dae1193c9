"""What crosses a plugin boundary, under the one name plugins written against flyscale have long
imported it by: this module only hands on the names of the modules that hold them.

flyscale uses a plugin by its shape: an object (or a class with a no-argument constructor)
registered under an entry point, e.g. in the plugin package's pyproject.toml:

    [project.entry-points."flyscale.models"]
    acme_resnet = "acme_flyscale.models:resnet"

When the registry loads a plugin it checks it against its kind's Protocol (every method
present, callable, and accepting the arguments flyscale passes), so a plugin of the wrong shape
is refused before any task starts. What a plugin returns (a dataset's info, a gate's verdict)
may be any object with the fields of `DatasetInfo` or `GateVerdict`, or a mapping of them:
flyscale converts it where it receives it. Plugin authors who want the types import them from
`flyscale.api`, the stable re-export of these modules.

Where each lives: the records and their conversions in `records`; the Protocols by kind in
`data_protocols` (datasets, augmentations), `strategy_protocol` (strategies and their traits),
`model_protocols` (models, quantizers, gates) and `objective_protocol` (objectives, evaluators);
what the registry holds each kind to in `kinds`.
"""

from flyscale.plugin.data_protocols import AugmentationPlugin, DatasetPlugin
from flyscale.plugin.kinds import (
    ALTERNATIVES,
    ARGUMENTS_WHEN,
    OPTIONAL_ATTRIBUTES,
    OPTIONAL_METHODS,
    PROTOCOLS,
    REQUIRED_WHEN,
    SIGNATURE_HINTS,
)
from flyscale.plugin.model_protocols import GatePlugin, ModelPlugin, QuantizerPlugin
from flyscale.plugin.objective_protocol import Evaluator, ObjectivePlugin
from flyscale.plugin.records import (
    DTYPES,
    ENCODINGS,
    SOURCE_FILE,
    SOURCE_KEY,
    SOURCE_PROBLEM,
    SOURCE_ROW,
    DatasetInfo,
    FieldSpec,
    GateVerdict,
    ObjectiveContext,
    as_dataset_info,
    as_gate_verdict,
    cost_name,
    costed,
)
from flyscale.plugin.strategy_protocol import StrategyPlugin, StrategyTraits, fixed_workers, traits_of

__all__ = [
    "ALTERNATIVES",
    "ARGUMENTS_WHEN",
    "DTYPES",
    "ENCODINGS",
    "OPTIONAL_ATTRIBUTES",
    "OPTIONAL_METHODS",
    "PROTOCOLS",
    "REQUIRED_WHEN",
    "SIGNATURE_HINTS",
    "SOURCE_FILE",
    "SOURCE_KEY",
    "SOURCE_PROBLEM",
    "SOURCE_ROW",
    "AugmentationPlugin",
    "DatasetInfo",
    "DatasetPlugin",
    "Evaluator",
    "FieldSpec",
    "GatePlugin",
    "GateVerdict",
    "ModelPlugin",
    "ObjectiveContext",
    "ObjectivePlugin",
    "QuantizerPlugin",
    "StrategyPlugin",
    "StrategyTraits",
    "as_dataset_info",
    "as_gate_verdict",
    "cost_name",
    "costed",
    "fixed_workers",
    "traits_of",
]
