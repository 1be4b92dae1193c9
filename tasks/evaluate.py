"""Evaluation stages: test metrics for the fp32 model, quantization measured side by side with
it, and the gates, which judge all of it against the champion as it is now."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.config import GatesConfig, MlflowConfig, ModelConfig, ObjectiveConfig, QuantizeConfig
from flyscale.data import fields, shards
from flyscale.data.shards import Shards
from flyscale.data.tensors import batches, calibration_batches
from flyscale.data.tokenize import TokenStats
from flyscale.evaluate import gating
from flyscale.evaluate.comparison import compare
from flyscale.evaluate.gating import Judgment
from flyscale.evaluate.metrics import EvalMetrics, evaluate_batches
from flyscale.evaluate.quantize import quantize
from flyscale.flyte.caching import code_cache
from flyscale.flyte.provenance import TaskRun
from flyscale.model import build_model, file_sha256, load_state, save_state
from flyscale.plugin.contracts import DatasetInfo, ObjectiveContext
from flyscale.render import plots
from flyscale.render.decks import evaluation_html
from flyscale.tracking.champion import read_baseline
from flyscale.train import objective as objectives
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


def objective_context(info: DatasetInfo, tokens: TokenStats | None, tokenizer: FlyteFile | None) -> ObjectiveContext:
    """What the objective's evaluation may need besides the model: the info, and for text the
    tokenizer (to decode samples) and the bytes a token (for bits per byte)."""
    return ObjectiveContext(
        info,
        bytes_per_token=tokens.bytes_per_token if tokens is not None else 0.0,
        tokenizer_json=Path(tokenizer.download()).read_text() if tokenizer is not None else "",
    )


def latency_inputs(objective: Any, info: DatasetInfo) -> dict[str, Any]:
    """What one timed call of the latency comparison is given. A language model's (an objective
    that pairs inputs): a full window of token ids, so one call is one generated token without a
    KV cache, at batch 1, 8 and 32. Anyone else's: float32 noise in the input's shape."""
    pair = objectives.pairing(objective)
    spec = info.input()
    if pair is None or spec is None or spec.dtype.startswith("float"):
        return {}
    high = int(spec.range[1]) + 1 if spec.range else 2

    def make_input(b: int, generator: torch.Generator) -> torch.Tensor:
        ids = torch.randint(0, high, (b, *spec.shape), generator=generator)
        return pair(ids, torch.zeros(b, dtype=torch.long))[0]

    return {"make_input": make_input, "batch_sizes": TOKEN_BATCH_SIZES, "unit": "token"}


TOKEN_BATCH_SIZES = (1, 8, 32)


@task(cache=code_cache("models", "objectives"), **TASK, requests=SMALL)
def evaluate_model(
    weights: FlyteFile,
    test: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    tokens: TokenStats | None = None,
    tokenizer: FlyteFile | None = None,
) -> Evaluated:
    """The objective's metrics of the trained model on the test split (a classifier's accuracy,
    macro-F1, per-class precision and recall, calibration and confusion matrix; a language
    model's perplexity and bits per byte, and its continuations of fixed prompts), and the
    fingerprint of that split. Text (`tokens`, `tokenizer`): bits per byte, and samples decoded."""
    run = TaskRun.start("evaluate_model")
    path = weights.download()
    model = load_state(build_model(model_cfg, info), path)
    context = objective_context(info, tokens, tokenizer)
    metrics = evaluate_batches(model, batches(test, info), objectives.of(objective), context)
    metrics.weights_sha256 = file_sha256(path)
    return Evaluated(EvaluatedModel(metrics, shards.content_sha256(test.dir.download())), run.done())


@task(
    cache=code_cache("models", "quantizers", "objectives"), **TASK, requests=SMALL, enable_deck=True, deck_fields=DECKS
)
def quantize_model(
    weights: FlyteFile,
    train: Shards,
    test: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    cfg: QuantizeConfig,
    fp32: EvalMetrics,
    history: TrainHistory,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    tokens: TokenStats | None = None,
    tokenizer: FlyteFile | None = None,
) -> Quantized:
    """Quantize (calibrating on training rows where the quantizer needs it), evaluate the int8
    model on the same test split, and time both models side by side at batch 1, 8, 64 and 256.
    Then draws the run's figures, once: for the Deck, and for the register task to log
    (`history` gives the learning curves)."""
    run = TaskRun.start("quantize_model")
    goal = objectives.of(objective)
    model = load_state(build_model(model_cfg, info), weights.download())
    qmodel = quantize(model, cfg, calibration_batches(train, info))
    metrics = evaluate_batches(qmodel, batches(test, info), goal, objective_context(info, tokens, tokenizer))
    comparison = compare(
        model,
        qmodel,
        cfg.name,
        fp32,
        metrics,
        fields.model_input_shape(info),
        metrics=goal.metrics,
        **latency_inputs(goal, info),
    )
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
