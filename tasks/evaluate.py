"""Evaluation stages: test metrics for the fp32 model, quantization measured side by side with
it, and the gates, which judge all of it against the champion as it is now."""

from __future__ import annotations

import tempfile
from typing import NamedTuple

from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.config import GatesConfig, MlflowConfig, ModelConfig, QuantizeConfig
from flyscale.data import fields, shards
from flyscale.data.shards import Shards
from flyscale.data.tensors import batches, calibration_batches
from flyscale.evaluate import gating
from flyscale.evaluate.comparison import compare
from flyscale.evaluate.gating import Judgment
from flyscale.evaluate.metrics import EvalMetrics, evaluate_batches
from flyscale.evaluate.quantize import quantize
from flyscale.flyte.caching import code_cache
from flyscale.flyte.provenance import TaskRun
from flyscale.model import build_model, file_sha256, load_state, save_state
from flyscale.plugin.contracts import DatasetInfo
from flyscale.render import plots
from flyscale.render.decks import evaluation_html
from flyscale.tracking.champion import read_baseline
from flyscale.train.telemetry import TrainHistory
from tasks.common import DECKS, SMALL, TASK
from tasks.records import EvaluatedModel, QuantizedModel


class Evaluated(NamedTuple):
    model: EvaluatedModel
    run: TaskRun


class Quantized(NamedTuple):
    model: QuantizedModel
    run: TaskRun


class Judged(NamedTuple):
    judgment: Judgment
    passed: bool


@task(cache=code_cache("models"), **TASK, requests=SMALL)
def evaluate_model(weights: FlyteFile, test: Shards, info: DatasetInfo, model_cfg: ModelConfig) -> Evaluated:
    """Accuracy, macro-F1, per-class precision and recall, calibration and the confusion matrix
    of the trained model on the test split, and the fingerprint of that split."""
    run = TaskRun.start("evaluate_model")
    path = weights.download()
    model = load_state(build_model(model_cfg, info), path)
    metrics = evaluate_batches(model, batches(test, info), info.num_classes)
    metrics.weights_sha256 = file_sha256(path)
    return Evaluated(EvaluatedModel(metrics, shards.content_sha256(test.dir.download())), run.done())


@task(cache=code_cache("models", "quantizers"), **TASK, requests=SMALL, enable_deck=True, deck_fields=DECKS)
def quantize_model(
    weights: FlyteFile,
    train: Shards,
    test: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: QuantizeConfig,
    fp32: EvalMetrics,
    history: TrainHistory,
) -> Quantized:
    """Quantize (calibrating on training rows where the quantizer needs it), evaluate the int8
    model on the same test split, and time both models side by side at batch 1, 8, 64 and 256.
    Then draws the run's figures, once: for the Deck, and for the register task to log
    (`history` gives the learning curves)."""
    run = TaskRun.start("quantize_model")
    model = load_state(build_model(model_cfg, info), weights.download())
    qmodel = quantize(model, cfg, calibration_batches(train, info))
    metrics = evaluate_batches(qmodel, batches(test, info), info.num_classes)
    comparison = compare(model, qmodel, cfg.name, fp32, metrics, fields.model_input_shape(info))
    figures = plots.draw_run(tempfile.mkdtemp(prefix="flyscale-plots-"), fp32, metrics, comparison, history)
    Deck("Evaluation", evaluation_html(fp32, metrics, comparison, figures))
    weights_int8 = FlyteFile(save_state(qmodel, "model_int8.pt"))
    return Quantized(QuantizedModel(weights_int8, metrics, comparison, FlyteDirectory(figures)), run.done())


# Never cached: a verdict is only as good as the champion it was judged against, so every run
# reads the champion afresh (an unchanged champion gives the same judgment, and registration
# after it stays a cache hit).
@task(cache=False, **TASK, requests=SMALL)
def gate_model(fp32: EvaluatedModel, int8: QuantizedModel, cfg: GatesConfig, champion_of: MlflowConfig) -> Judged:
    """Every configured gate against the live champion; each verdict says why, and against whom."""
    champion = read_baseline(champion_of, fp32.metrics.weights_sha256)
    metrics = {**fp32.metrics.scalars(), **int8.metrics.scalars("int8_"), **int8.comparison.scalars()}
    judgment = gating.judge(cfg, metrics, champion, fp32.test_sha256)
    return Judged(judgment=judgment, passed=judgment.passed)
