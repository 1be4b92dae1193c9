"""Evaluation stages: test metrics for the fp32 model, quantization measured side by side with
it, and the gates, which judge all of it against the champion as it is now."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import zipfile
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
from flyscale.evaluate.quantize import quantize, quantize_onnx, works_on_onnx
from flyscale.export import onnx
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
from tasks.records import EvaluatedModel, ExportedModel, QuantizedModel, ServedModel

log = logging.getLogger(__name__)


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
    onnx_model: FlyteFile,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    tokens: TokenStats | None = None,
    tokenizer: FlyteFile | None = None,
) -> Quantized:
    """Quantize (calibrating on training rows where the quantizer needs it), evaluate the int8
    model on the same test split, and time both models side by side at batch 1, 8, 64 and 256.
    An ONNX quantizer (the default) quantizes `onnx_model`, the export, and both models are
    measured through ONNX Runtime, as they will be served; a torch.ao one, the torch module.
    Then draws the run's figures, once: for the Deck, and for the register task to log
    (`history` gives the learning curves)."""
    run = TaskRun.start("quantize_model")
    goal = objectives.of(objective)
    fp32_model: torch.nn.Module
    qmodel: torch.nn.Module
    exported = Path(onnx_model.download())
    if works_on_onnx(cfg) and (exported.stat().st_size == 0 or zipfile.is_zipfile(exported)):  # none, or a .pt2
        fallback = QuantizeConfig(name="torch_dynamic_int8")
        log.warning(
            "quantizer %r quantizes the ONNX export, and this model has none (ONNX cannot take it): its int8 copy is made by %r "
            "(torch.ao, deprecated) instead",
            cfg.name,
            fallback.name,
        )
        cfg = fallback
    if works_on_onnx(cfg):  # the exported file, quantized and measured as it will be served
        calibration = None
        if cfg.plugin.attribute("calibrates"):
            calibration = [
                onnx.model_inputs(x, torch.zeros(len(x), dtype=torch.long), goal).numpy()
                for x in calibration_batches(train, info)
            ]
        served = onnx.OnnxModule(exported)
        served_int8 = onnx.OnnxModule(quantize_onnx(served.path, cfg, calibration))
        fp32 = dataclasses.replace(fp32, size_bytes=served.size_bytes())  # sizes of the files served
        fp32_model, qmodel, out, fmt = served, served_int8, str(served_int8.path), "onnx"
    else:
        fp32_model = load_state(build_model(model_cfg, info), weights.download())
        qmodel = quantize(fp32_model, cfg, calibration_batches(train, info))
        out, fmt = save_state(qmodel, "model_int8.pt"), "torch"
    metrics = evaluate_batches(qmodel, batches(test, info), goal, objective_context(info, tokens, tokenizer))
    if fmt == "onnx":
        metrics.size_bytes = Path(out).stat().st_size
    comparison = compare(
        fp32_model,
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
    quantized = QuantizedModel(FlyteFile(out), metrics, comparison, FlyteDirectory(figures), fmt, cfg.name)
    return Quantized(quantized, run.done())


# Never cached: a verdict is only as good as the champion it was judged against, so every run
# reads the champion afresh (an unchanged champion gives the same judgment, and registration
# after it stays a cache hit).
@task(cache=False, **TASK, requests=SMALL)
def gate_model(
    fp32: EvaluatedModel,
    int8: QuantizedModel,
    exported: ExportedModel,
    served: ServedModel,
    cfg: GatesConfig,
    champion_of: MlflowConfig,
) -> Judged:
    """Every configured gate against the live champion; each verdict says why, and against whom.
    The gates see the test metrics, int8's, the export's parity and the served model's load test."""
    champion = read_baseline(champion_of, fp32.metrics.weights_sha256)
    metrics = {
        **fp32.metrics.scalars(),
        **int8.metrics.scalars("int8_"),
        **int8.comparison.scalars(),
        **({"onnx_max_abs_diff": exported.max_abs_diff} if exported.exported else {}),
        **served.scalars(),
    }
    judgment = gating.judge(cfg, metrics, champion, fp32.test_sha256)
    return Judged(judgment=judgment, passed=judgment.passed)
