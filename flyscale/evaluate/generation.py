"""Text from a causal language model: the prompt's ids, then one sampled token at a time.

Any model that maps token ids (N, T) to next-token logits (N, T, vocabulary) works. There is no
KV cache: each new token runs the model over the whole window (the last `context` ids) again,
so a token costs a forward pass over up to `context` positions. That is what the served model
and the Deck's samples do, and what the generation benchmark measures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.inference_mode()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    context: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`ids` (N, T) followed by `max_new_tokens` sampled ones; temperature 0 takes the likeliest.

    The model is put in eval mode (no dropout) and left so.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: always the likeliest token), got {temperature}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
    return ids
