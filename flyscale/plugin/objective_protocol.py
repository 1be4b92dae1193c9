"""The Protocol of an objective (what training optimises, what evaluation measures, what the
served model returns), and of the evaluator it makes for the test split."""

from __future__ import annotations

from typing import Any, Protocol

from flyscale.plugin.records import ObjectiveContext


class Evaluator(Protocol):
    """Metrics streamed over the test split's batches: memory holds what the metrics need, never
    the split. `update` gets the model's outputs and the targets of one batch (after `pair`);
    `result` returns flyscale.api.EvalMetrics with `objective`, `loss`, `n` and `values` set (a
    classifier fills its own fields too)."""

    def update(self, outputs: Any, targets: Any) -> None: ...

    def result(self) -> Any: ...


class ObjectivePlugin(Protocol):
    """What training optimises, what evaluation measures, and what the served model returns.

    `loss(outputs, targets)`: the mean loss of a batch, what the optimizer follows.
    `score(outputs, targets)`: (summed loss, hits, count) of a batch, as 0-d tensors but count an
    int: validation sums them over batches and ranks, so its loss is the mean per counted target
    (an example, or a token) and its accuracy hits / count (the top-1 class, or next token).
    `evaluator(context)`: a fresh Evaluator for the test split.
    `metrics`: {name or glob: True when higher is better} of what the evaluator reports; the
    gates may bound these (and `loss`, `size_bytes`, latencies); `headline` names the one metric
    that sums the objective up (one of `metrics`).
    Optional `pair(x, y)`: what the model is given and what it is scored against, from a batch
    of the dataset (default: the inputs and the labels; a language model predicts each token
    from those before it: (x[:, :-1], x[:, 1:])).
    Optional `samples(model, context)`: {prompt: what the model made of it}, shown in the Deck and
    MLflow (a language model's continuation of fixed prompts).
    Optional `with_options(options)`: the objective configured with its parsed options (an
    instance of `options_type`); flyscale calls it once and uses what it returns.
    Optional `predict(model, model_input, params, context)` and `example(context)`: what the
    registered model returns for an input (MLflow pyfunc's `predict`, `params` its inference
    params) and (an input example, default params or None), which its signature is inferred
    from. Without them the served model takes float32 inputs and returns the raw outputs.
    Optional `serving(context)`: how the registered model answers without flyscale, from its ONNX
    export (flyscale/export/onnx_pyfunc/predictor.py): {"output": "probabilities"}, {"output": "values",
    "scalar": bool}, or {"output": "text", "window": int, "max_new_tokens": int, "temperature":
    float}. An objective with its own `predict` and no `serving` is registered as a PyTorch model
    that needs flyscale and its plugin to load (a warning says so).
    `labelled` (default True): the dataset must have a label; a language model needs none.
    `real_valued` (default False): the label must be a float field (a regression target), not a
    class id; the reader then reads it as float32.
    `scaling_metric` (default "loss"): what a scaling study fits, "loss" (score's summed loss per
    count) or "error" (1 - hits / count, a classifier's).
    `unit` (default "example"): what score's count counts; a language model's is "token", and
    its scaling study's data axis is then training tokens.
    """

    metrics: dict[str, bool]
    headline: str

    def loss(self, outputs: Any, targets: Any) -> Any: ...

    def score(self, outputs: Any, targets: Any) -> tuple[Any, Any, int]: ...

    def evaluator(self, context: ObjectiveContext) -> Evaluator: ...
