"""Built-in objectives: what training optimises, what evaluation measures, what the gates see.

- `classification`: one class per example; cross-entropy; accuracy, macro-F1, per-class
  precision and recall, calibration and the confusion matrix.
- `language_modeling`: every token predicted from those before it; the mean cross-entropy per
  token, its exponential (the perplexity), bits per token and per byte of text, next-token
  accuracy, evaluation tokens per second, and continuations of fixed prompts.
- `regression`: real-valued targets; MSE (or MAE) loss; MAE, RMSE and R².
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from flyscale.api import ClassificationEvaluator, EvalMetrics, ObjectiveContext, generate


class Classification:
    """Logits (N, classes) against labels (N,)."""

    options_type = None
    metrics = {"accuracy": True, "macro_f1": True, "ece": False, "precision_class_*": True, "recall_class_*": True}
    headline = "accuracy"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        loss = F.cross_entropy(outputs, targets, reduction="sum")
        return loss, (outputs.argmax(1) == targets).sum(), len(targets)

    def evaluator(self, context: ObjectiveContext) -> ClassificationEvaluator:
        return ClassificationEvaluator(context.info.num_classes)


@dataclass
class LanguageModelingOptions:
    # Continued in the Deck and MLflow after evaluation (greedy, so a rerun shows the same text).
    prompts: list[str] = field(default_factory=lambda: ["The "])
    sample_tokens: int = 80  # tokens generated after each prompt

    def __post_init__(self):
        if self.sample_tokens < 0:
            raise ValueError(f"sample_tokens must be >= 0, got {self.sample_tokens}")


class TokenEvaluator:
    """Summed next-token cross-entropy and hits over every target token."""

    def __init__(self, bytes_per_token: float):
        self.bytes_per_token = bytes_per_token
        self.loss_sum, self.hits, self.count = 0.0, 0, 0
        self.started = time.perf_counter()

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        self.loss_sum += float(F.cross_entropy(flat, targets.reshape(-1), reduction="sum"))
        self.hits += int((flat.argmax(1) == targets.reshape(-1)).sum())
        self.count += targets.numel()

    def result(self) -> EvalMetrics:
        loss = self.loss_sum / max(self.count, 1)
        bits = loss / math.log(2)
        values = {
            "perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
            "bits_per_token": bits,
            "token_accuracy": self.hits / max(self.count, 1),
            "tokens_per_s": self.count / max(time.perf_counter() - self.started, 1e-9),
        }
        if self.bytes_per_token > 0:  # text whose bytes were counted when it was tokenized
            values["bits_per_byte"] = bits / self.bytes_per_token
        return EvalMetrics(
            accuracy=0.0,
            macro_f1=0.0,
            loss=loss,
            n=self.count,
            confusion=[],
            size_bytes=0,
            objective="language_modeling",
            values=values,
        )


class LanguageModeling:
    """Logits (N, T, vocabulary) for sequences of token ids (N, T + 1): each position predicts the
    next token, so the model reads tokens [0, T) and is scored against tokens [1, T]."""

    options_type = LanguageModelingOptions
    labelled = False

    def __init__(self, options: LanguageModelingOptions | None = None):
        self.options = options or LanguageModelingOptions()

    def with_options(self, options: LanguageModelingOptions) -> LanguageModeling:
        return LanguageModeling(options)

    metrics = {
        "perplexity": False,
        "bits_per_token": False,
        "bits_per_byte": False,
        "token_accuracy": True,
        "tokens_per_s": True,
    }
    headline = "perplexity"

    def pair(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :-1], x[:, 1:]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        flat = outputs.reshape(-1, outputs.shape[-1])
        loss = F.cross_entropy(flat, targets.reshape(-1), reduction="sum")
        return loss, (flat.argmax(1) == targets.reshape(-1)).sum(), targets.numel()

    def evaluator(self, context: ObjectiveContext) -> TokenEvaluator:
        return TokenEvaluator(context.bytes_per_token)

    def samples(self, model: nn.Module, context: ObjectiveContext) -> dict[str, str]:
        """Each prompt and its greedy continuation, decoded with the run's tokenizer."""
        tokens = context.info.input()
        if not context.tokenizer_json or tokens is None:
            return {}
        from flyscale.data.text import from_json  # the tokenizer's library only where text is made

        options = self.options
        tokenizer = from_json(context.tokenizer_json)
        window = tokens.shape[0] - 1  # the model reads sequences less their last token
        out = {}
        for prompt in options.prompts:
            ids = torch.as_tensor(tokenizer.encode_batch([prompt])[0], dtype=torch.long)[None, :]
            made = generate(model, ids, options.sample_tokens, window, temperature=0)
            out[prompt] = tokenizer.decode(made[0, ids.shape[1] :].tolist())
        return out


classification = Classification()
language_modeling = LanguageModeling()
