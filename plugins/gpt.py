"""A decoder-only transformer language model, written as karpathy/nanoGPT's model.py writes it,
but as an `nn.Sequential` of whole layers (the embeddings, one `Block` per transformer layer, the
head), so the pipeline strategy can cut it into stages and activation checkpointing can wrap each
block. It takes token ids (N, T), T at most the context, and returns logits (N, T, vocab).

Every parameter is initialised by the `reset_parameters()` of the module that holds it, with
nanoGPT's numbers, so a model materialised from the meta device (flyscale.train.meta) starts from
the same distribution as one built in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flyscale.api import DatasetInfo
from flyscale.api import generate as generate_tokens
from flyscale_plugins.models import _check_multipliers

STD = 0.02  # nanoGPT's (GPT-2's) standard deviation for every weight but the residual projections
INTEGER_DTYPES = ("uint8", "int32", "int64")


@dataclass
class GPTOptions:
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads; width must be divisible by them
    width: int = 128  # the residual stream (nanoGPT's n_embd)
    context: int = 0  # positions the model can see (block_size); 0: the dataset's sequence length
    dropout: float = 0.0
    # The head's weight is the token embedding's, one Parameter (as nanoGPT). Set it false for the
    # pipeline strategy: a tied weight cannot live on two stages, and its meta check refuses it.
    tie_embeddings: bool = True
    bias: bool = False  # biases in the Linear layers and LayerNorms, as nanoGPT's `bias`
    # For scaling studies: width x width_multiplier rounded to a multiple of heads (at least heads,
    # so the heads still divide it), and round(layers x depth_multiplier) blocks. 1: as given.
    width_multiplier: float = 1.0
    depth_multiplier: float = 1.0

    def __post_init__(self):
        for name in ("layers", "heads", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 0:
            raise ValueError(f"context must be a whole number >= 0 (0: the sequence length), got {self.context!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_multipliers(self)
        self.sizes()  # a multiplier that leaves no block fails here, before any work

    def sizes(self) -> tuple[int, int]:
        """(blocks, width) as the multipliers give them; the width a multiple of heads."""
        layers = math.floor(self.layers * self.depth_multiplier + 0.5)
        if layers < 1:
            raise ValueError(
                f"depth_multiplier {self.depth_multiplier:g} leaves none of the {self.layers} layers; "
                f"use a multiplier of at least {0.5 / self.layers:.3g}"
            )
        per_head = max(1, math.floor(self.width * self.width_multiplier / self.heads + 0.5))
        return layers, per_head * self.heads


class Linear(nn.Linear):
    """nn.Linear initialised as nanoGPT does: weight normal(0, std), bias zero."""

    def __init__(self, n_in: int, n_out: int, bias: bool, std: float = STD):
        self.std = std  # before nn.Linear's __init__, which calls reset_parameters
        super().__init__(n_in, n_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Module):
    """Token plus learned position embeddings, then dropout: the first layer."""

    def __init__(self, vocab: int, context: int, width: int, dropout: float):
        super().__init__()
        self.tok = nn.Parameter(torch.empty(vocab, width))
        self.pos = nn.Parameter(torch.empty(context, width))
        self.drop = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.tok, 0.0, STD)
        nn.init.normal_(self.pos, 0.0, STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > len(self.pos):
            raise ValueError(f"a sequence of {t} tokens is longer than the model's context of {len(self.pos)}")
        return self.drop(F.embedding(ids, self.tok) + self.pos[:t])


class CausalSelfAttention(nn.Module):
    """Multi-head attention of each position to itself and the positions before it.

    q, k and v are separate projections (not nanoGPT's fused c_attn) so that tensor parallelism
    can split each by heads (see `Block.tp_plan`); the forward counts heads from the width it is
    given, so a rank holding half of them computes its half.
    """

    def __init__(self, width: int, heads: int, dropout: float, bias: bool, out_std: float):
        super().__init__()
        self.heads, self.head_width, self.dropout = heads, width // heads, dropout
        self.q, self.k, self.v = (Linear(width, width, bias) for _ in range(3))
        self.c_proj = Linear(width, width, bias, out_std)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (f(x).view(n, t, -1, self.head_width).transpose(1, 2) for f in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(n, t, -1)))


class Block(nn.Module):
    """Pre-norm attention then a pre-norm MLP, each added to the residual stream: one layer."""

    # Tensor parallelism (Megatron's split, as torchtitan plans it): q, k, v and the MLP's first
    # projection split by output (whole heads, hidden units), the projections back split by
    # input and summed over the ranks. LayerNorms stay whole on every rank.
    tp_plan = {
        "attn.q": "colwise",
        "attn.k": "colwise",
        "attn.v": "colwise",
        "attn.c_proj": "rowwise",
        "mlp.0": "colwise",
        "mlp.2": "rowwise",
    }

    def __init__(self, width: int, heads: int, layers: int, dropout: float, bias: bool):
        super().__init__()
        # GPT-2: each block adds two projections to the residual stream; scaling them keeps its
        # variance at initialisation independent of depth.
        out_std = STD / math.sqrt(2 * layers)
        self.ln_1 = nn.LayerNorm(width, bias=bias)
        self.attn = CausalSelfAttention(width, heads, dropout, bias, out_std)
        self.ln_2 = nn.LayerNorm(width, bias=bias)
        self.mlp = nn.Sequential(
            Linear(width, 4 * width, bias), nn.GELU(), Linear(4 * width, width, bias, out_std), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TiedLinear(nn.Module):
    """The output projection by the token embedding's own weight (the same Parameter).

    It has no reset_parameters on purpose: the embedding initialises the weight. And
    flyscale.train.meta refuses to materialise a module without one, which is what a tied head
    needs: materialising layer by layer gives each layer its own tensor, so the tie would come
    apart silently (and under the pipeline strategy the two would live on different stages).
    """

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Head(nn.Module):
    """The final LayerNorm and one logit per token id: the last layer."""

    def __init__(self, width: int, vocab: int, bias: bool, tied: nn.Parameter | None):
        super().__init__()
        self.ln_f = nn.LayerNorm(width, bias=bias)
        self.lm_head: nn.Module = Linear(width, vocab, bias=False) if tied is None else TiedLinear(tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def vocabulary(info: DatasetInfo) -> tuple[int, int]:
    """(vocabulary size, sequence length) of a dataset of token ids; ValueError for any other input."""
    field = info.input()
    if (
        field is None
        or field.dtype not in INTEGER_DTYPES
        or len(field.shape) != 1
        or field.range is None
        or field.range[0] < 0
    ):
        has = (
            f"{field} with range {field.range}"
            if field is not None
            else f"a table of {len(info.feature_columns)} features"
        )
        raise ValueError(
            f"model 'gpt' needs token ids: a 1-D integer field with a range [0, vocab - 1], such as "
            f"tokens: int32[seq_len] (tokenize the documents first); dataset {info.name!r} has {has}"
        )
    return int(field.range[1]) + 1, int(field.shape[0])


class GPT:
    """A decoder-only transformer (nanoGPT's): next-token logits at every position."""

    options_type = GPTOptions

    def build(self, options: GPTOptions, info: DatasetInfo) -> nn.Sequential:
        vocab, seq_len = vocabulary(info)
        context = options.context or seq_len
        if context < seq_len:
            raise ValueError(
                f"context ({context}) is shorter than the {seq_len}-token sequences of dataset {info.name!r}; "
                f"set it to at least {seq_len}, or 0 for exactly that"
            )
        layers, width = options.sizes()
        embedding = Embedding(vocab, context, width, options.dropout)
        blocks = [Block(width, options.heads, layers, options.dropout, options.bias) for _ in range(layers)]
        head = Head(width, vocab, options.bias, embedding.tok if options.tie_embeddings else None)
        return nn.Sequential(embedding, *blocks, head)

    def huggingface(self, options: GPTOptions, info: DatasetInfo, model: nn.Sequential) -> tuple[dict, dict]:
        """This GPT as Hugging Face's GPT-2 (`GPT2LMHeadModel`): flyscale_plugins.gpt2_weights.to_gpt2."""
        from flyscale_plugins.gpt2_weights import to_gpt2

        return to_gpt2(options, info, model)

    def from_huggingface(self, options: GPTOptions, info: DatasetInfo, directory: str) -> dict[str, torch.Tensor]:
        """A GPT-2 folder's weights under this GPT's names: flyscale_plugins.gpt2_weights.from_gpt2."""
        from flyscale_plugins.gpt2_weights import from_gpt2

        return from_gpt2(options, directory)


def generate(
    model: nn.Sequential,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`ids` (N, T) followed by `max_new_tokens` sampled ones (flyscale.api.generate, with the
    window this model was built for); temperature 0 takes the likeliest. No KV cache."""
    embedding = model[0]
    if not isinstance(embedding, Embedding):
        raise TypeError(f"generate() takes a model built by 'gpt', whose first layer is an Embedding, not {embedding}")
    return generate_tokens(model, ids, max_new_tokens, len(embedding.pos), temperature, generator)


gpt = GPT()
