"""The stable surface for plugin authors. Importing it is optional.

flyscale uses a plugin by its shape and converts what the plugin returns at the boundary, so a
plugin package may depend on flyscale not at all. Authors who prefer to build flyscale's own
types, or to annotate against the Protocols, import them from here: these names stay put
across releases, whatever moves inside flyscale.

    from flyscale.api import DatasetInfo, GateVerdict, ModelPlugin
"""

from flyscale.contracts import (
    SOURCE_FILE,
    SOURCE_ROW,
    AugmentationPlugin,
    DatasetInfo,
    DatasetPlugin,
    GatePlugin,
    GateVerdict,
    ModelPlugin,
    QuantizerPlugin,
    StrategyPlugin,
)
from flyscale.distributed import DistContext
from flyscale.evaluation import higher_is_better
from flyscale.schemas import default_row_schema
from flyscale.training import TrainData, TrainResult

__all__ = [
    "DatasetInfo", "GateVerdict", "default_row_schema", "SOURCE_FILE", "SOURCE_ROW",
    "DatasetPlugin", "ModelPlugin", "AugmentationPlugin", "StrategyPlugin", "QuantizerPlugin", "GatePlugin",
    "DistContext", "TrainData", "TrainResult", "higher_is_better",
]
