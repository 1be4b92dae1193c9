"""What the registry holds each kind of plugin to: its Protocol, the methods and attributes it
may leave out (and their defaults), and what flyscale passes it. One table per question, so the
registry's checks read them and never a kind's name."""

from __future__ import annotations

from typing import Any

from flyscale.plugin.data_protocols import AugmentationPlugin, DatasetPlugin
from flyscale.plugin.model_protocols import GatePlugin, ModelPlugin, QuantizerPlugin
from flyscale.plugin.objective_protocol import ObjectivePlugin
from flyscale.plugin.strategy_protocol import StrategyPlugin

# What to change, for a method whose arguments changed since plugins were first written against it.
SIGNATURE_HINTS: dict[tuple[str, str], str] = {
    ("strategies", "__call__"): "take `hooks` after `options` and pass it to fit(..., hooks=hooks): it carries the "
    "run's checkpointer and live MLflow curves",
}

# Methods a kind may leave out, and the arguments flyscale passes when it is there.
OPTIONAL_METHODS: dict[str, dict[str, list[str]]] = {
    "datasets": {
        "row_schema": ["options"],
        "fingerprint": ["options"],
        "chunks": ["options"],
        "examples": ["options", "shard"],
        "shards": ["options"],
        "parts": ["options"],
        "part": ["options", "name"],
    },
    "strategies": {
        "check": ["model", "cfg", "options", "world_size"],
        # How many data-parallel replicas share the global batch (hybrid: the mesh's dp).
        "replicas": ["options", "world_size"],
        # The older form: the strategy trains by itself (see StrategyPlugin).
        "__call__": ["model", "data", "cfg", "ctx", "options", "hooks"],
    },
    # What the model is in Hugging Face's format: (its config.json as a dict, its state_dict there).
    "models": {
        "huggingface": ["options", "info", "model"],
        # A pretrained model: the checkpoint it starts from, the weights of a Hugging Face checkpoint
        # under its own names, and the checkpoint whose tokenizer makes the ids it reads.
        "pretrained": ["options"],
        "from_huggingface": ["options", "info", "directory"],
        "tokenizer": ["options"],
        # The trained model as it is kept (LoRA's adapters merged into the weights), and its options.
        "merged": ["options", "model"],
        # The options as a registered model keeps them: all it needs to rebuild where the files it
        # was built from are not (a checkpoint's config.json).
        "portable": ["options"],
    },
    "gates": {"reads": ["options"]},
    "objectives": {
        "pair": ["x", "y"],
        "samples": ["model", "context"],
        "with_options": ["options"],
        "predict": ["model", "model_input", "params", "context"],
        "example": ["context"],
        "serving": ["context"],
    },
}

# A method the Protocol declares that a plugin may leave out when it has the other:
# {kind: {method: its alternative}}.
ALTERNATIVES: dict[str, dict[str, str]] = {
    "datasets": {"load": "examples"},  # typed examples come as Arrow batches instead of one frame
    "strategies": {"parallelize": "__call__"},  # the older form, that trains by itself
}

# Attributes every kind may declare, and their value when a plugin leaves them out.
OPTIONAL_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "datasets": {"options_type": None, "default_augmentations": (), "streaming": False, "objective": "classification"},
    "models": {"options_type": None},
    "augmentations": {"options_type": None},
    "strategies": {"options_type": None, "traits": None},
    "quantizers": {"options_type": None, "calibrates": False, "works_on": "torch"},
    "gates": {"options_type": None, "compares_champion": False},
    "objectives": {
        "options_type": None,
        "labelled": True,
        "real_valued": False,
        "scaling_metric": "loss",
        "unit": "example",
    },
}

# An attribute that, when a plugin sets it true, needs an optional method: {kind: {attribute: method}}.
REQUIRED_WHEN: dict[str, dict[str, str]] = {
    "datasets": {"streaming": "chunks"},
}

# An attribute that, when a plugin sets it true, makes flyscale pass a method more arguments:
# {kind: {attribute: (method, [argument names])}}.
ARGUMENTS_WHEN: dict[str, dict[str, tuple[str, list[str]]]] = {
    "quantizers": {"calibrates": ("quantize", ["model", "options", "calibration"])},
}

PROTOCOLS: dict[str, type] = {
    "datasets": DatasetPlugin,
    "models": ModelPlugin,
    "augmentations": AugmentationPlugin,
    "strategies": StrategyPlugin,
    "quantizers": QuantizerPlugin,
    "gates": GatePlugin,
    "objectives": ObjectivePlugin,
}
