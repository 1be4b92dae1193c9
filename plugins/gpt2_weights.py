"""flyscale's GPT (flyscale_plugins.gpt) and Hugging Face's GPT-2 (`GPT2LMHeadModel`), the one's
weights under the other's names: what `flyscale huggingface` writes of a trained GPT, and what a
run that starts from a GPT-2 folder reads. The two compute the same function where the sizes and
choices agree; where they do not, reading is refused rather than approximated."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from flyscale.api import DatasetInfo
from flyscale_plugins.gpt import Block, Embedding, GPTOptions, Head, TiedLinear, vocabulary


def to_gpt2(options: GPTOptions, info: DatasetInfo, model: nn.Sequential) -> tuple[dict, dict]:
    """This GPT as Hugging Face's GPT-2 (`GPT2LMHeadModel`): the same computation under its
    names. GPT-2 fuses q, k and v into one projection and stores each projection transposed
    (its Conv1D); its LayerNorms and projections always have biases (zeros where ours have
    none); its GELU is the exact one when the config says "gelu"."""
    vocab, _ = vocabulary(info)
    layers = list(model)
    embedding, head = layers[0], layers[-1]
    blocks = [b for b in layers[1:-1] if isinstance(b, Block)]
    if not (isinstance(embedding, Embedding) and isinstance(head, Head) and len(blocks) == len(layers) - 2):
        raise TypeError("huggingface() takes a model built by 'gpt': an Embedding, Blocks and a Head")
    width = embedding.tok.shape[1]
    state: dict[str, torch.Tensor] = {
        "transformer.wte.weight": embedding.tok,
        "transformer.wpe.weight": embedding.pos,
    }

    def put(name: str, module: nn.Linear | nn.LayerNorm, transpose: bool = False) -> None:
        w = module.weight.t() if transpose else module.weight
        state[f"{name}.weight"] = w
        state[f"{name}.bias"] = module.bias if module.bias is not None else torch.zeros(w.shape[-1])

    for i, block in enumerate(blocks):
        at = f"transformer.h.{i}"
        put(f"{at}.ln_1", block.ln_1)
        put(f"{at}.ln_2", block.ln_2)
        attn = block.attn
        qkv = [attn.q, attn.k, attn.v]
        state[f"{at}.attn.c_attn.weight"] = torch.cat([f.weight for f in qkv]).t()
        state[f"{at}.attn.c_attn.bias"] = (
            torch.cat([f.bias for f in qkv]) if attn.q.bias is not None else torch.zeros(3 * width)
        )
        put(f"{at}.attn.c_proj", attn.c_proj, transpose=True)
        fc, proj = block.mlp[0], block.mlp[2]
        assert isinstance(fc, nn.Linear) and isinstance(proj, nn.Linear)  # Block's MLP, as built above
        put(f"{at}.mlp.c_fc", fc, transpose=True)
        put(f"{at}.mlp.c_proj", proj, transpose=True)
    put("transformer.ln_f", head.ln_f)
    tied = isinstance(head.lm_head, TiedLinear)
    if isinstance(head.lm_head, nn.Linear):
        state["lm_head.weight"] = head.lm_head.weight
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": len(embedding.pos),
        "n_embd": width,
        "n_layer": len(blocks),
        "n_head": options.heads,
        "n_inner": 4 * width,
        "activation_function": "gelu",  # nn.GELU(): the exact one, not GPT-2's tanh approximation
        "layer_norm_epsilon": blocks[0].ln_1.eps if blocks else 1e-5,
        "resid_pdrop": options.dropout,
        "embd_pdrop": options.dropout,
        "attn_pdrop": options.dropout,
        "tie_word_embeddings": tied,
    }
    return config, state


def from_gpt2(options: GPTOptions, directory: str) -> dict[str, torch.Tensor]:
    """A GPT-2 folder's weights (one `huggingface()` wrote, or another GPT-2 of the same sizes)
    under this GPT's names: q, k and v split out of the fused projection, the Conv1D weights
    transposed back. Refused where this GPT would compute something else: GPT-2's tanh GELU
    (`gelu_new`) where this one is exact, non-zero biases where it has none."""
    folder = Path(directory)
    if not (folder / "config.json").exists():
        raise ValueError(f"{directory} is not a local Hugging Face folder (no config.json): model 'gpt' reads one")
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "gpt2":
        raise ValueError(
            f"model 'gpt' starts from a GPT-2 checkpoint; {directory} holds a {config.get('model_type')!r}"
        )
    if config.get("activation_function", "gelu_new") != "gelu":
        raise ValueError(
            f"{directory}'s GPT-2 uses activation_function {config.get('activation_function', 'gelu_new')!r}; "
            f"model 'gpt' computes the exact GELU ('gelu'): it would not compute what that checkpoint does"
        )
    hf = _read_safetensors(folder)
    layers = int(config["n_layer"])
    state: dict[str, torch.Tensor] = {"0.tok": hf["transformer.wte.weight"], "0.pos": hf["transformer.wpe.weight"]}

    def put(ours: str, theirs: str, transpose: bool = False) -> None:
        w = hf[f"{theirs}.weight"]
        state[f"{ours}.weight"] = w.t().contiguous() if transpose else w
        bias = hf.get(f"{theirs}.bias")
        if options.bias:
            state[f"{ours}.bias"] = bias if bias is not None else torch.zeros(w.shape[-1 if transpose else 0])
        elif bias is not None and bool(bias.any()):
            raise ValueError(
                f"{directory} has non-zero biases ({theirs}.bias); set model.options.bias: true to start from it"
            )

    for i in range(layers):
        ours, theirs = f"{i + 1}", f"transformer.h.{i}"
        put(f"{ours}.ln_1", f"{theirs}.ln_1")
        put(f"{ours}.ln_2", f"{theirs}.ln_2")
        qkv_w, qkv_b = hf[f"{theirs}.attn.c_attn.weight"].t(), hf[f"{theirs}.attn.c_attn.bias"]
        for name, w, b in zip("qkv", qkv_w.chunk(3), qkv_b.chunk(3)):
            hf[f"{theirs}.attn.{name}.weight"], hf[f"{theirs}.attn.{name}.bias"] = w.t(), b
            put(f"{ours}.attn.{name}", f"{theirs}.attn.{name}", transpose=True)
        put(f"{ours}.attn.c_proj", f"{theirs}.attn.c_proj", transpose=True)
        put(f"{ours}.mlp.0", f"{theirs}.mlp.c_fc", transpose=True)
        put(f"{ours}.mlp.2", f"{theirs}.mlp.c_proj", transpose=True)
    head = f"{layers + 1}"
    put(f"{head}.ln_f", "transformer.ln_f")
    lm_head = hf.get("lm_head.weight", hf["transformer.wte.weight"])
    if options.tie_embeddings and not torch.equal(lm_head, hf["transformer.wte.weight"]):
        raise ValueError(
            f"{directory} has an output projection of its own (lm_head.weight, not the token embedding's); "
            "set model.options.tie_embeddings: false to start from it"
        )
    state[f"{head}.lm_head.weight"] = lm_head
    return state


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained folder: model.safetensors, or the shards its index names."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(directory / name)))
    return tensors
