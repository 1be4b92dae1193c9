"""The plugin contract: what the registry accepts, what it refuses (and says), what it converts."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
from torch import nn

from flyscale.api import DatasetInfo, GateVerdict
from flyscale.config import (
    AugmentConfig,
    DataConfig,
    GateConfig,
    GatesConfig,
    ModelConfig,
    PipelineConfig,
    flatten,
)
from flyscale.data import shards
from flyscale.data import source as data
from flyscale.data.augment import augment
from flyscale.data.prepare import prepare_table
from flyscale.evaluate import gating
from flyscale.evaluate.gating import ChampionRef
from flyscale.plugin import registry
from flyscale.plugin.contracts import as_dataset_info, as_gate_verdict
from flyscale.plugin.registry import PluginContractError


@pytest.fixture
def register():
    """Register plugins in code for one test, and forget them after it."""
    added = []

    def add(kind: str, name: str, plugin):
        added.append((kind, name))
        return registry.ALL[kind].register(name, plugin)

    yield add
    for kind, name in added:
        registry.ALL[kind].unregister(name)


class Model:
    built = 0

    def __init__(self):
        Model.built += 1

    def build(self, options, info):
        return nn.Linear(len(info.feature_columns), info.num_classes)


def test_a_class_is_instantiated_once_and_then_used_like_an_instance(register):
    Model.built = 0
    plugin = register("models", "t_class", Model)
    assert isinstance(plugin, Model) and Model.built == 1
    assert registry.models.get("t_class") is plugin and Model.built == 1
    model = ModelConfig(name="t_class").plugin.plugin.build(None, DatasetInfo("d", 3, [2], ["a", "b"]))
    assert isinstance(model, nn.Linear) and model.out_features == 3


class NeedsArgs:
    def __init__(self, path):
        self.path = path

    def build(self, options, info): ...


class Misspelt:
    def biuld(self, options, info): ...


class WrongArity:
    def build(self, info): ...


class NotCallable:
    build = "mlp"


class BadOptions:
    options_type = dict

    def build(self, options, info): ...


@pytest.mark.parametrize(
    "plugin, message",
    [
        (NeedsArgs, "names the class NeedsArgs, which cannot be built without arguments"),
        (Misspelt, "has no method build(options, info)"),
        (WrongArity, "has build(info), not build(options, info)"),
        (NotCallable, "has a build that is not callable"),
        (BadOptions, "has options_type = <class 'dict'>; expected a dataclass or None"),
    ],
)
def test_a_plugin_of_the_wrong_shape_is_refused_with_what_it_lacks(register, plugin, message):
    with pytest.raises(PluginContractError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        register("models", "t_wrong", plugin)
    assert "model plugin 't_wrong'" in str(err.value)


def test_callable_kinds_are_checked_as_callables(register):
    with pytest.raises(PluginContractError, match=r"is not callable as \(x, rng, options\)"):
        register("augmentations", "t_aug", object())
    with pytest.raises(
        PluginContractError,
        match=r"has \(model, data\), not \(model, data, cfg, ctx, options, hooks\): take `hooks` after `options`",
    ):
        register("strategies", "t_strategy", lambda model, data: None)


def test_a_dataset_may_leave_out_row_schema_but_not_load(register):
    class Tabular:
        def load(self, options):
            return pd.DataFrame({"a": [0.0, 1.0, np.nan, 2.0], "b": [1.0, 1.0, 1.0, 9.0], "label": [0, 1, 1, 5]})

        def info(self, options):
            return {
                "name": "tab",
                "num_classes": 2,
                "input_shape": [2],
                "feature_columns": ["a", "b"],
                "feature_ranges": {"b": [0, 5]},
            }

    register("datasets", "t_tab", Tabular)
    cfg = DataConfig(dataset="t_tab", max_quarantine_fraction=1.0)
    frame, info = data.load(cfg)
    assert info == DatasetInfo("tab", 2, [2], ["a", "b"], feature_ranges={"b": [0.0, 5.0]})
    # Without a row schema of its own, rows are checked against what its info declares.
    prepared = prepare_table(frame, cfg, info)
    bad = shards.read(prepared.quarantined.dir.path).sort_values("source_row", ignore_index=True)
    assert prepared.report.valid_rows == 2 and bad["source_row"].tolist() == [2, 3]
    assert "a: finite" in bad["reason"][0] or "a: not_nullable" in bad["reason"][0]
    assert "b: in_range" in bad["reason"][1] and "label: class in [0, 2)" in bad["reason"][1]

    class NoLoad:
        def info(self, options): ...

    with pytest.raises(PluginContractError, match=r"has no method load\(options\)"):
        register("datasets", "t_noload", NoLoad)


def test_a_streaming_dataset_must_say_how_to_read_its_chunks(register):
    class Streams:
        streaming = True

        def load(self, options): ...

        def info(self, options): ...

    with pytest.raises(PluginContractError, match=r"sets streaming = True but has no method chunks\(options\)"):
        register("datasets", "t_stream_nochunks", Streams)

    class Chunks(Streams):
        def chunks(self, options):
            yield pd.DataFrame()

    register("datasets", "t_stream_chunks", Chunks)  # conforms


@dataclass
class OwnInfo:
    name: str
    num_classes: int
    input_shape: tuple
    feature_columns: list


def test_returned_objects_are_converted_at_the_boundary():
    info = as_dataset_info(OwnInfo("x", 2, (1, 2), ["a", "b"]), "dataset 'x'")
    assert type(info) is DatasetInfo and info.input_shape == [1, 2] and info.label_column == "label"
    with pytest.raises(TypeError, match=r"dataset 'x': info\(\) has no field 'feature_columns'"):
        as_dataset_info({"name": "x", "num_classes": 2, "input_shape": [2]}, "dataset 'x'")
    with pytest.raises(TypeError, match=r"dataset 'x': info\(\) returned fields of the wrong type"):
        as_dataset_info(OwnInfo("x", "two", (2,), ["a", "b"]), "dataset 'x'")

    @dataclass
    class Verdict:
        name: str
        passed: bool
        reason: str

    assert as_gate_verdict(Verdict("g", np.bool_(True), "ok"), "gate 'g'") == GateVerdict("g", True, "ok")
    assert as_gate_verdict({"name": "g", "passed": False, "reason": "no"}, "gate 'g'").passed is False
    # A publication decision is never a truthy string.
    with pytest.raises(TypeError, match=r"gate 'g': check\(\) returned passed='yes'"):
        as_gate_verdict(Verdict("g", "yes", "?"), "gate 'g'")


def test_a_gate_returning_its_own_object_is_judged_through_flyscale(register):
    class Always:
        def check(self, metrics, options, champion):
            return {"name": "always", "passed": True, "reason": f"accuracy {metrics['accuracy']}"}

    register("gates", "t_always", Always)
    judgment = gating.judge(GateConfig(name="t_always"), {"accuracy": 0.5}, ChampionRef("m", "champion"))
    assert judgment.verdict == GateVerdict("always", True, "accuracy 0.5")


def test_generic_sections_hold_no_plugin_defaults():
    # beats_champion takes no threshold: the gate's defaults come from its own options dataclass.
    gate = GateConfig(name="beats_champion")
    assert gate.options == {} and dataclasses.asdict(gate.plugin.options)["min_absolute_change"] is None
    flat = flatten(PipelineConfig(gate=GatesConfig(gates=[gate])))
    assert flat["gate.gates.0.name"] == "beats_champion" and flat["gate.gates.0.options.metric"] == "accuracy"
    assert "gate.gates.0.options.threshold" not in flat
    assert flatten(PipelineConfig())["gate.gates.0.options.threshold"] == 0.95  # min_metric's own default
    # Augmentations default to what fits the dataset's kind of data.
    assert PipelineConfig().augment.names == ["shift", "noise"]
    parquet = PipelineConfig(data=DataConfig(dataset="parquet", options={"path": "s3://b/p"}))
    assert parquet.augment.names == ["gaussian_noise"]
    assert PipelineConfig(augment=AugmentConfig(names=[])).augment.names == []


def test_a_dataset_without_default_augmentations_gets_none(register):
    class Bare:
        def load(self, options): ...

        def info(self, options): ...

    register("datasets", "t_bare", Bare)
    assert PipelineConfig(data=DataConfig(dataset="t_bare")).augment.names == []
    # Options for an augmentation that then does not run are an error that says why.
    with pytest.raises(ValueError, match=r"augment.options.noise: 'noise' is not listed in augment.names \[\].*t_bare"):
        PipelineConfig(data=DataConfig(dataset="t_bare"), augment=AugmentConfig(options={"noise": {"std": 0.1}}))


def test_value_ranges_come_from_the_dataset_not_from_digits():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"a": rng.uniform(100, 200, 64), "b": rng.uniform(-5, 5, 64), "label": [0, 1] * 32})
    cfg = AugmentConfig(names=["noise"], options={"noise": {"std": 0.5}}, copies=1)
    free = DatasetInfo("t", 2, [2], ["a", "b"])
    out = augment(frame, free, cfg).iloc[64:]
    assert out["a"].min() < 100 and out["b"].min() < -5  # nothing clips to digits' [0, 16]
    bounded = DatasetInfo("t", 2, [2], ["a", "b"], feature_ranges={"a": [100.0, 200.0]})
    out = augment(frame, bounded, cfg).iloc[64:]
    assert out["a"].between(100, 200).all() and out["b"].min() < -5  # clipped only where declared


def test_options_are_resolved_once_and_never_travel_in_a_pickle():
    cfg = PipelineConfig()
    assert cfg.model.plugin is cfg.model.plugin  # validation's result is the one everyone uses
    copy = pickle.loads(pickle.dumps(cfg))
    assert "_resolved" not in copy.model.__dict__  # a worker resolves through its own registry
    assert copy.model.plugin.options == cfg.model.plugin.options
    cfg.model.options = {"hidden": [8]}  # an edit after construction is seen, not served stale
    assert cfg.model.plugin.options.hidden == [8]
