"""Evaluation stages: test metrics for the fp32 model, the gate, and int8 quantization."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task
from flytekit.types.file import FlyteFile

from flyscale import artifacts, data, gating, tracking
from flyscale.caching import code_cache
from flyscale.config import GateConfig, MlflowConfig, ModelConfig, QuantizeConfig
from flyscale.contracts import DatasetInfo, GateVerdict
from flyscale.evaluation import EvalMetrics, evaluate_batches
from flyscale.gating import Judgment
from flyscale.provenance import TaskRun
from flyscale.shards import Shards
from tasks.common import IMAGE, SMALL

Evaluated = NamedTuple("Evaluated", [("metrics", EvalMetrics), ("run", TaskRun)])
Quantized = NamedTuple(
    "Quantized", [("weights", FlyteFile), ("metrics", EvalMetrics), ("verdict", GateVerdict), ("run", TaskRun)]
)


@task(cache=code_cache("models"), container_image=IMAGE, requests=SMALL)
def evaluate_model(weights: FlyteFile, test: Shards, info: DatasetInfo, model_cfg: ModelConfig) -> Evaluated:
    """Accuracy, macro-F1 and confusion matrix of the trained model on the test split."""
    run = TaskRun.start("evaluate_model")
    path = weights.download()
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), path)
    metrics = evaluate_batches(model, data.batches(test, info), info.num_classes)
    metrics.weights_sha256 = artifacts.file_sha256(path)
    return Evaluated(metrics=metrics, run=run.done())


# Never cached: a verdict is only as good as the champion it was judged against, so every run
# reads the champion afresh (an unchanged champion gives the same judgment, and registration
# after it stays a cache hit).
@task(cache=False, container_image=IMAGE, requests=SMALL)
def gate_model(metrics: EvalMetrics, cfg: GateConfig, champion_of: MlflowConfig) -> Judgment:
    """Judge the candidate against the live champion; the judgment says why, and against whom."""
    champion = tracking.read_baseline(champion_of, metrics.weights_sha256)
    return gating.judge(cfg, metrics.scalars(), champion)


@task(cache=code_cache("models", "quantizers"), container_image=IMAGE, requests=SMALL)
def quantize_model(
    weights: FlyteFile,
    test: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: QuantizeConfig,
    fp32: EvalMetrics,
) -> Quantized:
    """Quantize, evaluate the quantized model, and gate on the accuracy it lost."""
    run = TaskRun.start("quantize_model")
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), weights.download())
    qmodel = artifacts.quantize(model, cfg)
    metrics = evaluate_batches(qmodel, data.batches(test, info), info.num_classes)
    drop = fp32.accuracy - metrics.accuracy
    passed = drop <= cfg.max_accuracy_drop
    verdict = GateVerdict(
        name="quantization",
        passed=passed,
        reason=f"{cfg.name} accuracy drop {drop:+.4f} {'<=' if passed else '>'} allowed {cfg.max_accuracy_drop:.4f}",
    )
    weights_int8 = FlyteFile(artifacts.save_state(qmodel, "model_int8.pt"))
    return Quantized(weights=weights_int8, metrics=metrics, verdict=verdict, run=run.done())
