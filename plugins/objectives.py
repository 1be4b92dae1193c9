"""Built-in objectives: what training optimises, what evaluation measures, what the gates see.

- `classification`: one class per example; cross-entropy; accuracy, macro-F1, per-class
  precision and recall, calibration and the confusion matrix.
- `language_modeling`: every token predicted from those before it; the mean cross-entropy per
  token, its exponential (the perplexity), bits per token and per byte of text, next-token
  accuracy, evaluation tokens per second, and continuations of fixed prompts.
- `regression`: real-valued targets; MSE (or MAE) loss; MAE, RMSE and R².
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from flyscale.api import ClassificationEvaluator, EvalMetrics, ObjectiveContext, generate, input_example


class Classification:
    """Logits (N, classes) against labels (N,)."""

    options_type = None
    metrics = {"accuracy": True, "macro_f1": True, "ece": False, "precision_class_*": True, "recall_class_*": True}
    headline = "accuracy"
    scaling_metric = "error"  # a study fits 1 - accuracy, whose noise is binomial

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        loss = F.cross_entropy(outputs, targets, reduction="sum")
        return loss, (outputs.argmax(1) == targets).sum(), len(targets)

    def evaluator(self, context: ObjectiveContext) -> ClassificationEvaluator:
        return ClassificationEvaluator(context.info.num_classes)

    def example(self, context: ObjectiveContext) -> tuple[np.ndarray, None]:
        return input_example(context.info), None

    def serving(self, context: ObjectiveContext) -> dict:
        return {"output": "probabilities"}  # as predict: a softmax of the scores

    def predict(self, model: nn.Module, model_input, params: dict, context: ObjectiveContext) -> np.ndarray:
        """Class probabilities, a row per example, for inputs of the declared shape."""
        x = torch.as_tensor(np.asarray(model_input, dtype="float32"))
        model.eval()
        with torch.inference_mode():
            return torch.softmax(model(x), dim=1).numpy()


@dataclass
class LanguageModelingOptions:
    # Continued in the Deck and MLflow after evaluation, sampled at `temperature` with seed 0: the
    # same weights show the same text. (Greedy decoding of a small model mostly loops on one word.)
    prompts: list[str] = field(default_factory=lambda: ["The "])
    sample_tokens: int = 80  # tokens generated after each prompt
    # The served model's defaults, each overridable per request as an MLflow inference param.
    max_new_tokens: int = 64
    temperature: float = 0.8

    def __post_init__(self):
        if self.sample_tokens < 0:
            raise ValueError(f"sample_tokens must be >= 0, got {self.sample_tokens}")
        if self.max_new_tokens < 1:  # the served model refuses a request for none
            raise ValueError(f"max_new_tokens must be >= 1 (the served model's default), got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: always the likeliest token), got {self.temperature}")


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


@functools.lru_cache(maxsize=4)
def _tokenizer(saved: str):
    """The tokenizer a model carries, built once, not on every request to the served model (a
    BPE's JSON is parsed into Hugging Face's tokenizer)."""
    from flyscale.data.text import from_json  # the tokenizer's library only where text is made

    return from_json(saved)


class LanguageModeling:
    """Logits (N, T, vocabulary) for sequences of token ids (N, T + 1): each position predicts the
    next token, so the model reads tokens [0, T) and is scored against tokens [1, T]."""

    options_type = LanguageModelingOptions
    labelled = False
    unit = "token"  # score counts tokens: a scaling study's data axis is training tokens

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

        prompts = self.options.prompts
        made = self.continue_text(model, prompts, self.options.sample_tokens, self.options.temperature, 0, context)
        return dict(zip(prompts, made))

    def continue_text(
        self,
        model: nn.Module,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        context: ObjectiveContext,
    ) -> list[str]:
        """Each prompt's continuation (the new text only). Prompts of the same length in tokens
        are generated as one batch; an empty prompt starts from the end-of-text token."""
        tokens = context.info.input()
        if tokens is None or not context.tokenizer_json:
            raise ValueError("a language model is served with its tokenizer; this one was registered without it")
        tokenizer = _tokenizer(context.tokenizer_json)
        window = tokens.shape[0] - 1  # the model reads sequences less their last token
        encoded = [ids if len(ids) else np.array([tokenizer.eot]) for ids in tokenizer.encode_batch(list(prompts))]
        out = [""] * len(prompts)
        generator = torch.Generator().manual_seed(seed)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        for length, rows in by_length.items():
            batch = torch.as_tensor(np.stack([encoded[i] for i in rows]), dtype=torch.long)
            made = generate(model, batch, max_new_tokens, window, temperature, generator)
            for i, row in zip(rows, made[:, length:].tolist()):
                out[i] = tokenizer.decode(row)
        return out

    def serving(self, context: ObjectiveContext) -> dict:
        """Generation as predict does it, window and defaults included (sampling draws from
        numpy's generator there, so a seeded sample differs from torch's; greedy is the same)."""
        tokens = context.info.input()
        if tokens is None:
            raise ValueError("a language model's dataset declares its token field")
        return {
            "output": "text",
            "window": tokens.shape[0] - 1,
            "max_new_tokens": self.options.max_new_tokens,
            "temperature": self.options.temperature,
        }

    def example(self, context: ObjectiveContext) -> tuple[list[str], dict]:
        """Prompts are one unnamed string column: MLflow then takes a string, a list of them, or
        a one-column DataFrame."""
        params = {"max_new_tokens": self.options.max_new_tokens, "temperature": self.options.temperature, "seed": 0}
        return self.options.prompts[:1] or ["The "], params

    def predict(self, model: nn.Module, model_input, params: dict, context: ObjectiveContext) -> list[str]:
        """Text in, text out: prompts (one string, a list of them, or a DataFrame's one column)
        and their continuations, in order. Params: max_new_tokens, temperature (0: greedy), seed."""
        if isinstance(model_input, pd.DataFrame):
            if model_input.shape[1] != 1:
                raise ValueError(f"a language model takes one column of prompts, got {list(model_input.columns)}")
            prompts = [str(p) for p in model_input.iloc[:, 0]]
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(p) for p in model_input]
        unknown = set(params) - {"max_new_tokens", "temperature", "seed"}
        if unknown:
            raise ValueError(
                f"unknown params {sorted(unknown)}: a language model takes max_new_tokens, temperature, seed"
            )
        return self.continue_text(
            model,
            prompts,
            int(params.get("max_new_tokens", self.options.max_new_tokens)),
            float(params.get("temperature", self.options.temperature)),
            int(params.get("seed", 0)),
            context,
        )


classification = Classification()
language_modeling = LanguageModeling()
