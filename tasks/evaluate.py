"""Evaluation stages: test metrics for the fp32 model, the gate, and int8 quantization."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task
from flytekit.types.file import FlyteFile
from pandera.typing import DataFrame

from flyscale import artifacts, data, gating, tracking
from flyscale.caching import code_cache
from flyscale.config import GateConfig, MlflowConfig, ModelConfig, QuantizeConfig
from flyscale.contracts import DatasetInfo, GateVerdict
from flyscale.evaluation import EvalMetrics, evaluate
from flyscale.schemas import LabeledFrame
from tasks.common import IMAGE, SMALL

Quantized = NamedTuple("Quantized", [("weights", FlyteFile), ("metrics", EvalMetrics), ("verdict", GateVerdict)])


@task(cache=code_cache("models"), container_image=IMAGE, requests=SMALL)
def evaluate_model(
    weights: FlyteFile, test: DataFrame[LabeledFrame], info: DatasetInfo, model_cfg: ModelConfig
) -> EvalMetrics:
    """Accuracy, macro-F1 and confusion matrix of the trained model on the test split."""
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), weights.download())
    x, y = data.to_tensors(test, info)
    return evaluate(model, x, y, info.num_classes)


# The verdict depends on the champion in the MLflow store, so the store is part of the cache key.
# An identical rerun replays the verdict it got; `pyflyte run --overwrite-cache` re-judges it.
@task(cache=code_cache("gates", extra=tracking.tracking_uri), container_image=IMAGE, requests=SMALL)
def gate_model(metrics: EvalMetrics, cfg: GateConfig, champion_of: MlflowConfig) -> GateVerdict:
    """Decide whether the model may become champion; the verdict says why."""
    champion = tracking.champion_metrics(champion_of.model_name, champion_of.alias)
    return gating.judge(cfg, metrics.scalars(), champion)


@task(cache=code_cache("models", "quantizers"), container_image=IMAGE, requests=SMALL)
def quantize_model(
    weights: FlyteFile,
    test: DataFrame[LabeledFrame],
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: QuantizeConfig,
    fp32: EvalMetrics,
) -> Quantized:
    """Quantize, evaluate the quantized model, and gate on the accuracy it lost."""
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), weights.download())
    qmodel = artifacts.quantize(model, cfg)
    x, y = data.to_tensors(test, info)
    metrics = evaluate(qmodel, x, y, info.num_classes)
    drop = fp32.accuracy - metrics.accuracy
    passed = drop <= cfg.max_accuracy_drop
    verdict = GateVerdict(
        name="quantization",
        passed=passed,
        reason=f"{cfg.name} accuracy drop {drop:+.4f} {'<=' if passed else '>'} allowed {cfg.max_accuracy_drop:.4f}",
    )
    return Quantized(weights=FlyteFile(artifacts.save_state(qmodel, "model_int8.pt")), metrics=metrics, verdict=verdict)
