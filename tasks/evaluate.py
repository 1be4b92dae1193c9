"""Evaluation stages: test metrics for the fp32 model, quantization measured side by side with
it, and the gates, which judge all of it against the champion as it is now."""

from __future__ import annotations

import tempfile
from typing import NamedTuple

from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale import artifacts, data, gating, plots, report, shards, tracking
from flyscale.caching import code_cache
from flyscale.comparison import Comparison, compare
from flyscale.config import GatesConfig, MlflowConfig, ModelConfig, QuantizeConfig
from flyscale.contracts import DatasetInfo
from flyscale.evaluation import EvalMetrics, evaluate_batches
from flyscale.gating import Judgment
from flyscale.provenance import TaskRun
from flyscale.shards import Shards
from flyscale.training import TrainHistory
from tasks.common import DECKS, SMALL, TASK

Evaluated = NamedTuple("Evaluated", [("metrics", EvalMetrics), ("test_sha256", str), ("run", TaskRun)])
# plots: the run's figures as PNGs (flyscale/plots.py RUN_PLOTS), drawn once here for the Deck
# and logged as they are by the register task.
Quantized = NamedTuple("Quantized", [("weights", FlyteFile), ("metrics", EvalMetrics), ("comparison", Comparison),
                                     ("plots", FlyteDirectory), ("run", TaskRun)])
Judged = NamedTuple("Judged", [("judgment", Judgment), ("passed", bool)])


@task(cache=code_cache("models"), **TASK, requests=SMALL)
def evaluate_model(weights: FlyteFile, test: Shards, info: DatasetInfo, model_cfg: ModelConfig) -> Evaluated:
    """Accuracy, macro-F1, per-class precision and recall, calibration and the confusion matrix
    of the trained model on the test split, and the fingerprint of that split."""
    run = TaskRun.start("evaluate_model")
    path = weights.download()
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), path)
    metrics = evaluate_batches(model, data.batches(test, info), info.num_classes)
    metrics.weights_sha256 = artifacts.file_sha256(path)
    return Evaluated(metrics=metrics, test_sha256=shards.content_sha256(test.dir.download()), run=run.done())


@task(cache=code_cache("models", "quantizers"), **TASK, requests=SMALL, enable_deck=True,
      deck_fields=DECKS)
def quantize_model(
    weights: FlyteFile, train: Shards, test: Shards, info: DatasetInfo, model_cfg: ModelConfig, cfg: QuantizeConfig,
    fp32: EvalMetrics, history: TrainHistory,
) -> Quantized:
    """Quantize (calibrating on training rows where the quantizer needs it), evaluate the int8
    model on the same test split, and time both models side by side at batch 1, 8, 64 and 256.
    Then draws the run's figures, once: for the Deck, and for the register task to log
    (`history` gives the learning curves)."""
    run = TaskRun.start("quantize_model")
    model = artifacts.load_state(artifacts.build_model(model_cfg, info), weights.download())
    calibration = data.calibration_batches(train, info)
    qmodel = artifacts.quantize(model, cfg, calibration)
    metrics = evaluate_batches(qmodel, data.batches(test, info), info.num_classes)
    comparison = compare(model, qmodel, cfg.name, fp32, metrics, len(info.feature_columns))
    figures = plots.draw_run(tempfile.mkdtemp(prefix="flyscale-plots-"), fp32, metrics, comparison, history)
    Deck("Evaluation", report.evaluation_html(fp32, metrics, comparison, figures))
    weights_int8 = FlyteFile(artifacts.save_state(qmodel, "model_int8.pt"))
    return Quantized(weights=weights_int8, metrics=metrics, comparison=comparison, plots=FlyteDirectory(figures),
                     run=run.done())


# Never cached: a verdict is only as good as the champion it was judged against, so every run
# reads the champion afresh (an unchanged champion gives the same judgment, and registration
# after it stays a cache hit).
@task(cache=False, **TASK, requests=SMALL)
def gate_model(
    fp32: EvalMetrics, int8: EvalMetrics, comparison: Comparison, test_sha256: str, cfg: GatesConfig,
    champion_of: MlflowConfig,
) -> Judged:
    """Every configured gate against the live champion; each verdict says why, and against whom."""
    champion = tracking.read_baseline(champion_of, fp32.weights_sha256)
    metrics = {**fp32.scalars(), **int8.scalars("int8_"), **comparison.scalars()}
    judgment = gating.judge(cfg, metrics, champion, test_sha256)
    return Judged(judgment=judgment, passed=judgment.passed)
