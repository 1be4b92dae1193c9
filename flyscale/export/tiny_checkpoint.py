"""Small random Hugging Face checkpoints, made offline: something to fine-tune where no weights can
be downloaded (a laptop on a plane, CI), saved exactly as `save_pretrained` saves a real one.

    flyscale tiny-checkpoint llama --out models/tiny-llama        # a causal LM, byte-level tokenizer
    flyscale tiny-checkpoint bert --labels 10 --out models/tiny-bert
    flyscale tiny-checkpoint vit --labels 4 --image-size 32 --out models/tiny-vit

A text model's tokenizer is the byte-level one (the 256 bytes, then <|endoftext|>, which ends a
sequence): it needs no training, so the checkpoint depends only on the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flyscale.data.text import ByteTokenizer
from flyscale.export.huggingface import tokenizer_files

ARCHITECTURES = ("llama", "gpt2", "bert", "vit")


def _config(arch: str, labels: int, image_size: int, channels: int, width: int, layers: int, positions: int):
    """(the config, the model class) of a small `arch`."""
    import transformers

    eot = ByteTokenizer.eot
    text: dict[str, Any] = dict(
        vocab_size=ByteTokenizer.vocab_size, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot
    )
    blocks: dict[str, Any] = dict(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=4
    )
    made: dict[str, tuple[type, type, dict[str, Any]]] = {
        "llama": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            {
                **text,
                **blocks,
                "num_key_value_heads": 2,
                "max_position_embeddings": positions,
                "tie_word_embeddings": False,
            },
        ),
        "gpt2": (
            transformers.GPT2Config,
            transformers.GPT2LMHeadModel,
            {**text, "n_embd": width, "n_layer": layers, "n_head": 4, "n_positions": positions},
        ),
        "bert": (
            transformers.BertConfig,
            transformers.BertForSequenceClassification,
            {**text, **blocks, "max_position_embeddings": positions, "num_labels": labels},
        ),
        "vit": (
            transformers.ViTConfig,
            transformers.ViTForImageClassification,
            {
                **blocks,
                "image_size": image_size,
                "patch_size": max(1, image_size // 8),
                "num_channels": channels,
                "num_labels": labels,
            },
        ),
    }
    config_class, model_class, kwargs = made[arch]
    return config_class(**kwargs), model_class


def make(
    arch: str,
    out: Path,
    *,
    labels: int = 2,
    image_size: int = 32,
    channels: int = 3,
    width: int = 64,
    layers: int = 2,
    positions: int = 256,
    seed: int = 0,
) -> Path:
    """A random `arch` checkpoint (see ARCHITECTURES) saved to `out` with its tokenizer (text
    models); the same arguments give the same weights."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config, model_class = _config(arch, labels, image_size, channels, width, layers, positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if arch != "vit":
        tokenizer_files(ByteTokenizer().to_json(), out, positions)
    return out
