"""Config: defaults work, presets load, bad values fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flyscale.config import (
    AugmentConfig,
    DataConfig,
    GateConfig,
    ModelConfig,
    PipelineConfig,
    QuantizeConfig,
    TrainConfig,
    effective,
    flatten,
    from_dict,
)

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_defaults_are_valid():
    cfg = PipelineConfig()
    assert cfg.data.dataset == "digits" and cfg.model.name == "mlp" and cfg.train.strategy == "ddp"


def _within(given, found) -> bool:
    """Every value `given` (a preset's) is in `found` (the effective config): mappings by key."""
    if isinstance(given, dict):
        return isinstance(found, dict) and all(k in found and _within(v, found[k]) for k, v in given.items())
    if isinstance(given, list) and given and isinstance(given[0], dict):
        return isinstance(found, list) and len(given) == len(found) and all(map(_within, given, found))
    return given == found


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_and_validates(preset):
    raw = yaml.safe_load(preset.read_text())
    if "scaling" in raw:  # a scaling study's preset: a pipeline preset plus its sweep
        from flyscale.scaling.config import ScalingConfig

        ScalingConfig(**raw.pop("scaling"))
    if "search" in raw:  # a search's preset: a pipeline preset plus its space, each end of it a valid config
        from flyscale.search.config import SearchStudyConfig

        assert SearchStudyConfig.from_dict(raw).search.space
        raw.pop("search")
    cfg = from_dict(raw)
    found = effective(cfg)  # plugin options with their defaults filled in
    for section, values in raw.items():
        if section == "gate":  # a list of gates, or one gate
            values = {"gates": values if isinstance(values, list) else [values]}
        assert _within(values, found[section]), f"{preset.name}: {section} not applied: {values} vs {found[section]}"


def test_presets_exist():
    assert {"digits-mlp", "digits-cnn", "quick"} <= {p.stem for p in PRESETS}


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TrainConfig(epochs=0), "train.epochs must be > 0"),
        (lambda: TrainConfig(lr=-1.0), "train.lr must be > 0"),
        (lambda: TrainConfig(strategy="zero3"), "train.strategy: unknown strateg"),
        (lambda: TrainConfig(options={"bucket_cap_mb": -1}), "train.options: bucket_cap_mb must be > 0"),
        (lambda: ModelConfig(name="vit"), "available: cnn, gpt, huggingface, mlp, resnet"),
        (lambda: ModelConfig(options={"hiden": [8]}), "model.options.hiden: unknown option"),
        (lambda: DataConfig(dataset="imagenet"), "data.dataset: unknown dataset 'imagenet'"),
        (lambda: DataConfig(test_fraction=0.9), "data.test_fraction must be in"),
        (lambda: AugmentConfig(names=["blur"]), "augment.names: unknown augmentation 'blur'"),
        (lambda: AugmentConfig(names=["shift"], options={"noise": {"std": 1}}), "augment.options.noise"),
        (lambda: AugmentConfig(options={"shift": {"max_shift": -1}}), "augment.options.shift: max_shift"),
        (lambda: GateConfig(options={"threshold": 2.0}), "gate.options: threshold must be in"),
        (lambda: QuantizeConfig(max_accuracy_drop=0.1), "quantize.max_accuracy_drop: unknown field"),
        (lambda: from_dict({"mlflow": {"promotion": "sometimes"}}), "mlflow.promotion must be 'auto' or 'manual'"),
        (
            lambda: from_dict(
                {
                    "data": {"dataset": "parquet_stream", "options": {"path": "/d"}},
                    "augment": {"names": ["gaussian_noise"]},
                }
            ),
            "augment.names: dataset 'parquet_stream' streams data larger than memory, which is not augmented",
        ),
        (lambda: from_dict({"trian": {}}), "unknown config section 'trian'"),
        (lambda: from_dict({"train": {"epoch": 3}}), "train.epoch: unknown field"),
        # Types are strict on every way in: keyword arguments, mappings, plugin options, lists' items.
        (lambda: TrainConfig(epochs=2.5), "train.epochs: expected an integer, got 2.5"),
        (lambda: TrainConfig(lr="0.1"), "train.lr: expected a number, got '0.1'"),
        (lambda: from_dict({"train": {"epochs": "5"}}), "train.epochs: expected an integer, got '5'"),
        (lambda: from_dict({"train": {"epochs": True}}), "train.epochs: expected an integer, got True"),
        (lambda: ModelConfig(options={"hidden": "abc"}), "model.options.hidden: expected a list, got 'abc'"),
        (lambda: ModelConfig(options={"hidden": [8, "x"]}), "model.options.hidden.1: expected an integer, got 'x'"),
        (lambda: from_dict({"gate": [{"name": "min_metric", "options": {"threshold": "high"}}]}), "threshold"),
        (lambda: from_dict({"mlflow": {"retries": 1.5}}), "mlflow.retries: expected an integer, got 1.5"),
        (lambda: from_dict({"export": {"fallback": "pt2"}}), "export.fallback must be one of"),
        (lambda: from_dict({"serving": {"time_budget_s": 0}}), "serving.time_budget_s must be > 0"),
        (lambda: from_dict({"serving": {"max_rows": 16}}), "serving.max_batch_size 32 exceeds serving.max_rows 16"),
        (
            lambda: from_dict(
                {
                    "data": {"dataset": "python_docs"},
                    "objective": {"name": "language_modeling", "options": {"max_new_tokens": 64}},
                    "serving": {"max_new_tokens": 32},
                }
            ),
            "objective.options.max_new_tokens 64 exceeds serving.max_new_tokens 32",
        ),
    ],
)
def test_bad_config_names_the_field(build, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        build()


def test_flatten_gives_dotted_params():
    flat = flatten(PipelineConfig())
    assert flat["train.epochs"] == 30
    assert flat["gate.gates.0.options.threshold"] == 0.95 and flat["gate.gates.1.name"] == "beats_champion"
    assert flat["gate.gates.2.name"] == "quantization"
    assert flat["model.name"] == "mlp"
    # Stable names: a section with no options adds no `{}` param beside other runs' nested keys.
    assert not any(v == {} for v in flat.values())


def test_a_preset_that_spells_out_a_default_is_the_same_config():
    """Options are kept in canonical form (what differs from the plugin's defaults), so a run's own
    config.yaml, every default spelled out, decodes to the config that wrote it."""
    short = from_dict({"model": {"options": {"hidden": [32]}}})
    spelled = from_dict(effective(short))
    assert spelled == short and flatten(spelled) == flatten(short)
    assert effective(short)["model"]["options"]["dropout"] is not None  # the defaults really were spelled out
    assert from_dict({"model": {"options": {"hidden": [256, 128]}}}).model.options == {}  # the default itself


def test_several_presets_merge_field_by_field_in_order():
    merged = PipelineConfig.merge(
        {"train": {"epochs": 3, "lr": 0.1}, "model": {"name": "cnn", "options": {"channels": [8]}}},
        {"train": {"lr": 0.01}},
        {"model": {"options": {"hidden": 16}}},
    )
    assert merged == {
        "train": {"epochs": 3, "lr": 0.01},
        "model": {"name": "cnn", "options": {"channels": [8], "hidden": 16}},
    }
    # Another plugin named later: the earlier plugin's options are not carried over to it.
    switched = PipelineConfig.merge(
        {"model": {"name": "cnn", "options": {"channels": [8]}}}, {"model": {"name": "mlp"}}
    )
    assert switched == {"model": {"name": "mlp"}}
    # Gates are a list: a later one replaces it whole.
    assert PipelineConfig.merge({"gate": [{"name": "min_metric"}]}, {"gate": {"name": "beats_champion"}}) == {
        "gate": {"gates": [{"name": "beats_champion"}]}
    }
