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
    flatten,
    from_dict,
)

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_defaults_are_valid():
    cfg = PipelineConfig()
    assert cfg.data.dataset == "digits" and cfg.model.name == "mlp" and cfg.train.strategy == "ddp"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_and_validates(preset):
    raw = yaml.safe_load(preset.read_text())
    if "scaling" in raw:  # a scaling study's preset: a pipeline preset plus its sweep
        from flyscale.scaling import ScalingConfig

        ScalingConfig(**raw.pop("scaling"))
    cfg = from_dict(raw)
    for section, values in raw.items():
        if section == "gate":  # a list of gates
            gates = values if isinstance(values, list) else [values]
            assert [(g.name, g.options) for g in cfg.gate.gates] == [(g["name"], g.get("options", {})) for g in gates]
            continue
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{preset.name}: {section}.{key} not applied"


def test_presets_exist():
    assert {"digits-mlp", "digits-cnn", "quick"} <= {p.stem for p in PRESETS}


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TrainConfig(epochs=0), "train.epochs must be > 0"),
        (lambda: TrainConfig(lr=-1.0), "train.lr must be > 0"),
        (lambda: TrainConfig(strategy="zero3"), "train.strategy: unknown strateg"),
        (lambda: TrainConfig(options={"bucket_cap_mb": -1}), "train.options: bucket_cap_mb must be > 0"),
        (lambda: ModelConfig(name="resnet"), "available: cnn, mlp"),
        (lambda: ModelConfig(options={"hiden": [8]}), "model.options.hiden: unknown option"),
        (lambda: DataConfig(dataset="imagenet"), "data.dataset: unknown dataset 'imagenet'"),
        (lambda: DataConfig(test_fraction=0.9), "data.test_fraction must be in"),
        (lambda: AugmentConfig(names=["blur"]), "augment.names: unknown augmentation 'blur'"),
        (lambda: AugmentConfig(names=["shift"], options={"noise": {"std": 1}}), "augment.options.noise"),
        (lambda: AugmentConfig(options={"shift": {"max_shift": -1}}), "augment.options.shift: max_shift"),
        (lambda: GateConfig(options={"threshold": 2.0}), "gate.options: threshold must be in"),
        (lambda: QuantizeConfig(max_accuracy_drop=0.1), "quantize.max_accuracy_drop: unknown field"),
        (lambda: from_dict({"mlflow": {"promotion": "sometimes"}}), "mlflow.promotion must be 'auto' or 'manual'"),
        (lambda: from_dict({"data": {"dataset": "parquet_stream", "options": {"path": "/d"}},
                            "augment": {"names": ["gaussian_noise"]}}),
         "augment.names: dataset 'parquet_stream' streams data larger than memory, which is not augmented"),
        (lambda: from_dict({"trian": {}}), "unknown config section 'trian'"),
        (lambda: from_dict({"train": {"epoch": 3}}), "train.epoch: unknown field"),
    ],
)
def test_bad_config_names_the_field(build, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        build()


def test_flatten_gives_dotted_params():
    flat = flatten(PipelineConfig())
    assert flat["train.epochs"] == 30
    assert flat["gate.gates.0.options.threshold"] == 0.95 and flat["gate.gates.1.name"] == "quantization"
    assert flat["model.name"] == "mlp"
    # Stable names: a section with no options adds no `{}` param beside other runs' nested keys.
    assert not any(v == {} for v in flat.values())
