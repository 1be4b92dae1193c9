"""Built-in objectives: what training optimises and validation measures.

- `classification`: one class per example; cross-entropy, and top-1 accuracy over examples.
- `language_modeling`: every token predicted from those before it; the mean cross-entropy per
  token (its exponential is the perplexity), and top-1 next-token accuracy over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Classification:
    """Logits (N, classes) against labels (N,)."""

    options_type = None

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        loss = F.cross_entropy(outputs, targets, reduction="sum")
        return loss, (outputs.argmax(1) == targets).sum(), len(targets)


class LanguageModeling:
    """Logits (N, T, vocabulary) for sequences of token ids (N, T + 1): each position predicts the
    next token, so the model reads tokens [0, T) and is scored against tokens [1, T]."""

    options_type = None

    def pair(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :-1], x[:, 1:]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        flat = outputs.reshape(-1, outputs.shape[-1])
        loss = F.cross_entropy(flat, targets.reshape(-1), reduction="sum")
        return loss, (flat.argmax(1) == targets.reshape(-1)).sum(), targets.numel()


classification = Classification()
language_modeling = LanguageModeling()
