"""A flyscale model in Hugging Face's format, for the rest of a team's tools: a folder with
config.json and model.safetensors (and, for a language model, its tokenizer as tokenizer.json
with tokenizer_config.json) that `transformers`' Auto classes load offline.

What the model is there is its plugin's to say: a model plugin with `huggingface(options, info,
model)` returns the config (a dict) and the model's weights under Hugging Face's names (the GPT
says it is a GPT-2). flyscale writes the files; it needs no `transformers` to do so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from flyscale.config import ModelConfig
from flyscale.plugin.records import DatasetInfo

EOT = "<|endoftext|>"


class NotExportable(ValueError):
    """The model's plugin does not say what its model is in Hugging Face's format."""


def save_pretrained(
    model_cfg: ModelConfig, info: DatasetInfo, model: nn.Module, tokenizer_json: str, out: Path
) -> Path:
    """Write `model` (built from `model_cfg` for `info`, weights loaded) to the folder `out` as
    Hugging Face's `save_pretrained` would; returns `out`."""
    r = model_cfg.plugin
    own = r.method("huggingface")
    if own is None:
        raise NotExportable(
            f"model {model_cfg.name!r} does not say what it is in Hugging Face's format (its plugin has no "
            "huggingface(options, info, model)); its weights are in the registered model as safetensors"
        )
    config, state = own(r.options, info, model)
    if tokenizer_json:  # where a document ends, as the tokenizer that made the model's ids says
        from flyscale.data.text import from_json

        config["bos_token_id"] = config["eos_token_id"] = from_json(tokenizer_json).eot
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_tensors(state, out / "model.safetensors")
    if tokenizer_json:
        positions = config.get("n_positions") or config.get("max_position_embeddings") or 1024
        tokenizer_files(tokenizer_json, out, int(positions))
    return out


def save_tensors(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """`state` as one safetensors file, each name its own copy: safetensors refuses two names on one
    storage, and a tied weight is stored under each of the names it has in `state`."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"}
    )


def tokenizer_files(tokenizer_json: str, out: Path, max_length: int) -> None:
    """tokenizer.json (the `tokenizers` library's) and tokenizer_config.json for a flyscale
    tokenizer's JSON: a BPE's is already the library's; a pretrained checkpoint's is its own,
    with its end-of-sequence token; the byte-level one becomes a byte-level BPE without merges
    whose ids are the bytes' values, <|endoftext|> after them."""
    data = json.loads(tokenizer_json)
    eos = pad = EOT
    if data.get("flyscale_tokenizer") == "byte":
        tokenizer_json = _byte_tokenizer(int(data["eot"]))
    elif data.get("flyscale_tokenizer") == "pretrained":
        from tokenizers import Tokenizer

        tokenizer_json = data["tokenizer"]
        saved = Tokenizer.from_str(tokenizer_json)
        eos = saved.id_to_token(int(data["eot"])) or EOT
        pad = saved.id_to_token(int(data.get("pad", data["eot"]))) or eos
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": eos,
                "eos_token": eos,
                "unk_token": eos,
                "pad_token": pad,  # what a classifier's rows are padded with (flyscale/data/tokenize.py)
                "model_max_length": max_length,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )


def _byte_tokenizer(eot: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab[EOT] = eot
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of each byte to a printable character, which byte-level tokenizers spell bytes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
