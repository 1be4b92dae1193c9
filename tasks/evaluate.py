"""Evaluation stages: test metrics for the fp32 model, quantization measured side by side with
it, and the gates, which judge all of it against the champion as it is now (scored on this run's
test split where a gate compares with it)."""

from __future__ import annotations

import dataclasses
import logging
import zipfile
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import torch
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.config import GatesConfig, MlflowConfig, ObjectiveConfig, QuantizeConfig
from flyscale.data import fields, shards
from flyscale.data.shards import Shards
from flyscale.data.tensors import batches, calibration_batches
from flyscale.data.tokenize import TokenStats
from flyscale.evaluate import gating
from flyscale.evaluate.comparison import Comparison, compare
from flyscale.evaluate.gating import Judgment
from flyscale.evaluate.metrics import EvalMetrics, evaluate_batches
from flyscale.evaluate.quantize import STATIC, quantize, quantize_onnx, works_on_onnx
from flyscale.export import onnx
from flyscale.flyte import outputs
from flyscale.flyte.caching import code_cache
from flyscale.flyte.content import BY_CONTENT
from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped
from flyscale.model import save_state
from flyscale.plugin.records import DatasetInfo, ObjectiveContext
from flyscale.render import plots
from flyscale.render.decks import evaluation_html
from flyscale.tracking import kind, same_split
from flyscale.tracking.champion import read_baseline
from flyscale.tracking.champion_reference import remeasure
from flyscale.train import objective as objectives
from flyscale.train.telemetry import TrainHistory
from tasks.common import DECKS, SMALL, TASK, TRACKED
from tasks.records import (
    EvaluatedModel,
    ExportedModel,
    ModelBundle,
    QuantizedModel,
    ServedModel,
    ValidatedData,
)

log = logging.getLogger(__name__)


class Evaluated(NamedTuple):
    model: EvaluatedModel
    run: TaskRun = UNSTAMPED  # filled in by @stamped


class Quantized(NamedTuple):
    model: Annotated[QuantizedModel, BY_CONTENT]  # keyed by content downstream
    run: TaskRun = UNSTAMPED  # filled in by @stamped


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
@stamped
def evaluate_model(model: ModelBundle, test: Shards, tokens: TokenStats | None = None) -> Evaluated:
    """The objective's metrics of the trained model on the test split (a classifier's accuracy,
    macro-F1, per-class precision and recall, calibration and confusion matrix; a language
    model's perplexity and bits per byte, and its continuations of fixed prompts), and the
    fingerprint of that split. Text (`tokens`, the bundle's tokenizer): bits per byte, and samples decoded."""
    context = objective_context(model.info, tokens, model.tokenizer)
    metrics = evaluate_batches(model.module(), batches(test, model.info), objectives.of(model.objective), context)
    metrics.weights_sha256 = model.weights_sha256
    return Evaluated(EvaluatedModel(metrics, shards.content_sha256(test.dir.download())))


@task(
    cache=code_cache("models", "quantizers", "objectives", ignored_inputs=("onnx_model",)),
    **TASK,
    requests=SMALL,
    enable_deck=True,
    deck_fields=DECKS,
)
@stamped
def quantize_model(
    model: ModelBundle,
    train: Shards,
    test: Shards,
    cfg: QuantizeConfig,
    fp32: EvalMetrics,
    history: TrainHistory,
    onnx_model: FlyteFile,
    onnx_sha256: str,  # ExportedModel.sha256 ("" with no export: an empty file)
    tokens: TokenStats | None = None,
) -> Quantized:
    """Quantize (calibrating on training rows where the quantizer needs it), evaluate the int8
    model on the same test split, and time both models side by side at batch 1, 8, 64 and 256.
    An ONNX quantizer (the default) quantizes `onnx_model`, the export, and both models are
    measured through ONNX Runtime, as they will be served; a torch.ao one, the torch module.
    Then draws the run's figures, once: for the Deck, and for the register task to log
    (`history` gives the learning curves)."""
    info = model.info
    goal = objectives.of(model.objective)
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
    context = objective_context(info, tokens, model.tokenizer)

    def measured(cfg: QuantizeConfig, fp32: EvalMetrics) -> tuple[EvalMetrics, Comparison, str]:
        """The int8 model `cfg` makes, evaluated and timed beside fp32: (its metrics, the comparison, its file)."""
        fp32_model: torch.nn.Module
        qmodel: torch.nn.Module
        if works_on_onnx(cfg):  # the exported file, quantized and measured as it will be served
            calibration = None
            if cfg.plugin.attribute("calibrates"):
                calibration = [
                    onnx.model_inputs(x, torch.zeros(len(x), dtype=torch.long), goal).numpy()
                    for x in calibration_batches(train, info)
                ]
            fp32_model = onnx.OnnxModule(exported)
            qmodel = onnx.OnnxModule(quantize_onnx(fp32_model.path, cfg, calibration))
            out = str(qmodel.path)
        else:
            fp32_model = model.module()
            qmodel = quantize(fp32_model, cfg, calibration_batches(train, info))
            out = save_state(qmodel, "model_int8.pt")
        metrics = evaluate_batches(qmodel, batches(test, info), goal, context)
        if works_on_onnx(cfg):
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
        return metrics, comparison.judge(), out

    if works_on_onnx(cfg):  # sizes of the files served
        fp32 = dataclasses.replace(fp32, size_bytes=onnx.OnnxModule(exported).size_bytes())
    metrics, comparison, out = measured(cfg, fp32)
    twin_always = cfg.twin == "always"
    if (
        not comparison.pays
        and not twin_always
        and works_on_onnx(cfg)
        and cfg.name != STATIC
        and onnx.has_convolutions(exported)
    ):
        # Dynamic int8 leaves convolutions in fp32 (ONNX Runtime's ConvInteger is slow on CPU):
        # on a convolutional model, static QDQ, calibrated on training rows, is what can pay.
        static = QuantizeConfig(name=STATIC, twin=cfg.twin)
        log.info("int8 %s; trying %s (QDQ) for the convolutions", comparison.verdict, STATIC)
        static_metrics, static_comparison, static_out = measured(static, fp32)
        if static_comparison.pays:
            static_comparison.verdict += f"; {cfg.name} was tried first and {comparison.verdict}"
            metrics, comparison, out, cfg = static_metrics, static_comparison, static_out, static
        else:
            comparison.verdict += (
                f"; {STATIC} (QDQ, for the convolutions) was tried too and {static_comparison.verdict}"
            )
    if not comparison.pays and twin_always:  # registered all the same, as config says
        comparison.pays, comparison.verdict = True, f"registered as quantize.twin: always says; it {comparison.verdict}"
    fmt = "onnx" if works_on_onnx(cfg) else "torch"
    figures = plots.draw_run(str(outputs.output_dir("flyscale-plots-")), fp32, metrics, comparison, history)
    Deck("Evaluation", evaluation_html(fp32, metrics, comparison, figures))
    quantized = QuantizedModel(
        FlyteFile(str(outputs.kept(out, "flyscale-int8-"))), metrics, comparison, FlyteDirectory(figures), fmt, cfg.name
    )
    return Quantized(quantized)


# Never cached: a verdict is only as good as the champion it was judged against, so every run
# reads the champion afresh (an unchanged champion gives the same judgment, and registration
# after it stays a cache hit).
@task(cache=False, **TRACKED, requests=SMALL)
def gate_model(
    fp32: EvaluatedModel,
    int8: QuantizedModel,
    exported: ExportedModel,
    served: ServedModel,
    cfg: GatesConfig,
    champion_of: MlflowConfig,
    test: Shards,
    validated: ValidatedData,
    objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
) -> Judged:
    """Every configured gate against the live champion; each verdict says why, and against whom.
    The gates see the test metrics, int8's, the export's parity and the served model's load test;
    a gate that compares with the champion sees it scored on this run's `test` split through its
    registered model. Drift is measured against that champion too, if validation (perhaps from
    the cache) measured it against another reference."""
    champion = read_baseline(champion_of, fp32.metrics.weights_sha256)
    info = validated.info
    if champion.version and gating.compares_champion(cfg):
        goal = objectives.of(objective)
        context = objective_context(info, validated.tokens, validated.tokenizer)
        candidate = kind.ModelKind.of(info, objective.name)
        champion = same_split.score(champion_of, champion, candidate, batches(test, info), goal, context)
    metrics = {
        **fp32.metrics.scalars(),
        **int8.metrics.scalars("int8_"),
        **int8.comparison.scalars(),
        **({"onnx_max_abs_diff": exported.max_abs_diff} if exported.exported else {}),
        **served.scalars(),
    }
    judgment = gating.judge(cfg, metrics, champion, fp32.test_sha256)
    again = remeasure(champion_of, champion, validated.report.reference, validated.profile)
    if again is not None:
        judgment = dataclasses.replace(
            judgment, remeasured=True, reference=again.reference, drift=again.drift, reference_note=again.note
        )
    return Judged(judgment=judgment, passed=judgment.passed)
