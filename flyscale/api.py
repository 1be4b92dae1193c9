"""The stable surface for plugin authors. Importing it is optional.

flyscale uses a plugin by its shape and converts what the plugin returns at the boundary, so a
plugin package may depend on flyscale not at all. Authors who prefer to build flyscale's own
types, or to annotate against the Protocols, import them from here: these names stay put
across releases, whatever moves inside flyscale.

    from flyscale.api import DatasetInfo, GateVerdict, ModelPlugin

A training strategy is a model transform: its `parallelize` returns a `Parallelized`, and it
declares its `StrategyTraits`; `train` (the trainer) does the rest. A strategy of the older form,
that trains by itself, builds on the loop's own pieces, which are here too: `fit` (the epochs,
with checkpoints and live curves through the `Hooks` it is handed), `TrainState` (what a
checkpoint holds), and `standard_step`, `make_optimizer` and `make_scheduler`.
"""

from flyscale.data.fields import input_example
from flyscale.data.schemas import default_row_schema
from flyscale.evaluate.generation import generate
from flyscale.evaluate.metrics import PLOTTED, ClassificationEvaluator, EvalMetrics, higher_is_better
from flyscale.plugin.data_protocols import AugmentationPlugin, DatasetPlugin
from flyscale.plugin.model_protocols import GatePlugin, ModelPlugin, QuantizerPlugin
from flyscale.plugin.objective_protocol import ObjectivePlugin
from flyscale.plugin.records import (
    SOURCE_FILE,
    SOURCE_KEY,
    SOURCE_PROBLEM,
    SOURCE_ROW,
    DatasetInfo,
    FieldSpec,
    GateVerdict,
    ObjectiveContext,
    cost_name,
)
from flyscale.plugin.strategy_protocol import StrategyPlugin, StrategyTraits
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.loop import Hooks, TrainResult
from flyscale.train.state import TrainState
from flyscale.train.step import make_optimizer, make_scheduler, standard_step
from flyscale.train.trainer import Parallelized, fit, train

__all__ = [
    "DatasetInfo",
    "FieldSpec",
    "GateVerdict",
    "default_row_schema",
    "SOURCE_FILE",
    "SOURCE_KEY",
    "SOURCE_PROBLEM",
    "SOURCE_ROW",
    "DatasetPlugin",
    "ModelPlugin",
    "AugmentationPlugin",
    "StrategyPlugin",
    "StrategyTraits",
    "Parallelized",
    "train",
    "QuantizerPlugin",
    "GatePlugin",
    "ObjectivePlugin",
    "ObjectiveContext",
    "EvalMetrics",
    "ClassificationEvaluator",
    "generate",
    "cost_name",
    "input_example",
    "PLOTTED",
    "DistContext",
    "TrainData",
    "TrainResult",
    "higher_is_better",
    "Hooks",
    "fit",
    "TrainState",
    "standard_step",
    "make_optimizer",
    "make_scheduler",
]
