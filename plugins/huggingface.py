"""A Hugging Face checkpoint as a flyscale model: a causal language model, a sequence classifier
or an image classifier, through transformers' `Auto*` classes.

The checkpoint is a folder saved by `save_pretrained` (config.json, model.safetensors, and for
text its tokenizer.json), or a hub id where the machine is online. `build` makes the
architecture from its config.json alone (on the meta device too, for fsdp); the checkpoint's
weights are what training starts from (`pretrained` and `from_huggingface`: flyscale fetches
them before any data work, holds them to the model, and keys the cache on their sha256), so
every strategy loads them the one way it loads `model.init_from`.

Every model is called as flyscale calls one: a batch of its input in, logits out. A causal LM
reads token ids (N, T) made by the checkpoint's own tokenizer (`tokenize.tokenizer` names the
same checkpoint), and returns (N, T, vocabulary); a sequence classifier reads token ids and an
image classifier images (N, C, H, W), each returning (N, labels). The checkpoint's labels must
be the dataset's classes in number.

For sharding, the model names its repeated blocks (`block_types`, from transformers'
`_no_split_modules`: a Llama's decoder layers): fsdp shards each as a unit. Parameters that
transformers' modules initialise without a `reset_parameters` (RMSNorm weights, the rotary
embedding's frequencies) get one that calls the model's own `_init_weights`, so a model built on
the meta device is materialised as every flyscale model is.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flyscale.api import DatasetInfo

TASKS = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}
# What an architecture's class name ends with, for each task (config.json's `architectures`).
SUFFIXES = {
    "ForCausalLM": "causal_lm",
    "LMHeadModel": "causal_lm",
    "ForSequenceClassification": "sequence_classification",
    "ForImageClassification": "image_classification",
}
PREFIX = "hf."  # where the transformers model sits in flyscale's module (its attribute name)


@dataclass
class LoraOptions:
    """Low-rank adapters (peft's LoRA): each targeted Linear layer W is used as W + (alpha / r) B A,
    with A (r x in) and B (out x r) the only weights that train; B starts at zero, so training
    starts from the checkpoint's own function."""

    r: int = 8  # the adapters' rank
    alpha: int = 16  # their scale is alpha / r
    dropout: float = 0.0  # on the adapters' input, while training
    # The Linear layers adapted, by the last part of their name (a Llama's q_proj, v_proj); empty:
    # peft's default for the architecture (its attention's query and value projections).
    target_modules: list[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"lora.r must be a whole number >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or self.alpha < 1:
            raise ValueError(f"lora.alpha must be a whole number >= 1, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class HuggingFaceOptions:
    # A folder saved by save_pretrained (config.json and the weights), or a hub id where online.
    path: str = ""
    # causal_lm, sequence_classification or image_classification; "": from config.json's architectures.
    task: str = ""
    # Fine-tune low-rank adapters only (peft's LoRA), merged into the weights when training ends;
    # none: every weight trains.
    lora: LoraOptions | None = None
    # config.json's content, which a registered model carries (`portable`) so that it rebuilds
    # where the checkpoint's folder is not; empty: read from `path`.
    config: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.path.strip():
            raise ValueError(
                "model.options.path must name a Hugging Face checkpoint: a folder saved by save_pretrained "
                "(config.json, model.safetensors), or a hub id where the machine is online"
            )
        if self.task and self.task not in TASKS:
            raise ValueError(
                f"model.options.task must be one of {', '.join(TASKS)} (or '' for config.json's), got {self.task!r}"
            )


def _config_of(options: HuggingFaceOptions):
    """The checkpoint's config: the one the options carry, else its folder's config.json."""
    if options.config:
        from transformers import AutoConfig

        given = dict(options.config)
        return AutoConfig.for_model(given.pop("model_type"), **given)
    return _config(options.path)


@functools.lru_cache(maxsize=8)
def _config(path: str):
    """The checkpoint's config.json, read once per process."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"model.options.path {path!r} is not a Hugging Face checkpoint that loads here (a folder with "
            f"config.json, or a hub id where the machine is online; `flyscale tiny-checkpoint llama --out DIR` "
            f"makes a small random one): {exc}"
        ) from None


def task_of(options: HuggingFaceOptions) -> str:
    """The task the options name, or the one config.json's architecture says."""
    if options.task:
        return options.task
    names = list(getattr(_config_of(options), "architectures", None) or [])
    for name in names:
        for suffix, task in SUFFIXES.items():
            if name.endswith(suffix):
                return task
    raise ValueError(
        f"cannot tell which task the checkpoint {options.path!r} is for (its config.json's architectures: "
        f"{names or 'none'}); set model.options.task to one of {', '.join(TASKS)}"
    )


def auto_class(task: str):
    import transformers

    return getattr(transformers, TASKS[task])


class HuggingFaceModel(nn.Module):
    """A transformers model called as every flyscale model is: its input in, logits out."""

    def __init__(self, hf: nn.Module, task: str):
        super().__init__()
        self.hf, self.task = hf, task
        # The repeated blocks (a Llama's decoder layers): what fsdp shards one at a time.
        self.block_types = tuple(getattr(hf, "_no_split_modules", None) or ())
        # A classifier's rows of labelled text end in padding (flyscale/data/tokenize.py pads with
        # the checkpoint tokenizer's pad id): the model attends to every other position. A causal
        # LM's packed sequences have no padding (their end-of-text ids, often the pad id, are text).
        pad = getattr(hf.config, "pad_token_id", None) if task == "sequence_classification" else None
        self.pad_id: int | None = None if pad is None else int(pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.task == "image_classification":
            return self.hf(pixel_values=x).logits
        if self.task == "causal_lm":
            return self.hf(input_ids=x, use_cache=False).logits
        if self.pad_id is not None:
            return self.hf(input_ids=x, attention_mask=(x != self.pad_id).long()).logits
        return self.hf(input_ids=x).logits


def _give_reset_parameters(hf: nn.Module) -> None:
    """A `reset_parameters` for every module that holds tensors of its own and has none (a norm's
    weight, rotary frequencies), calling the model's own initialisation of that module: what
    flyscale.train.meta asks of a model it materialises from the meta device."""
    init = getattr(hf, "_init_weights", None)
    if init is None:
        return
    for module in hf.modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None for t in own) and not callable(getattr(module, "reset_parameters", None)):
            # On the instance, beside transformers' own methods: nn.Module's __setattr__ is for tensors and modules.
            object.__setattr__(
                module, "reset_parameters", types.MethodType(lambda self, _init=init: _init(self), module)
            )


# peft's name for each task: a classifier's new head then trains whole beside the adapters.
PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def _with_lora(hf: nn.Module, task: str, lora: LoraOptions | None) -> nn.Module:
    """`hf` with LoRA adapters on its targeted Linear layers and every other weight frozen (but a
    classifier's head, which trains whole); `hf` itself without `lora`."""
    if lora is None:
        return hf
    from peft import LoraConfig, get_peft_model

    head: dict[str, Any] = (
        {"task_type": PEFT_TASKS[task]} if task in PEFT_TASKS else {"modules_to_save": ["classifier"]}
    )
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules or None, **head
    )
    try:
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` as it wraps a model:
            # nothing of the user's to change.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(hf, config)
    except ValueError as exc:  # peft names the modules it could not find
        raise ValueError(f"model.options.lora: {exc}") from None


def _check_fits(options: HuggingFaceOptions, task: str, config: Any, info: DatasetInfo) -> None:
    """The checkpoint against the dataset, before any data work: token ids it can embed, sequences
    it has positions for, labels as many as the classes, images of its size."""
    field = info.input()
    where = f"the checkpoint {options.path!r}"
    if task in ("causal_lm", "sequence_classification"):
        if (
            field is None
            or field.dtype not in ("uint8", "int32", "int64")
            or len(field.shape) != 1
            or field.range is None
        ):
            raise ValueError(
                f"{where} is a {task} model, which reads token ids; dataset {info.name!r} has "
                f"{field if field is not None else f'a table of {len(info.feature_columns)} features'}. "
                f"Tokenize its documents with the checkpoint's own tokenizer (tokenize.tokenizer: {options.path})"
            )
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if field.range[1] >= vocab:
            raise ValueError(
                f"{where} embeds {vocab} token ids, but dataset {info.name!r}'s ids reach {field.range[1]}: "
                f"tokenize with the checkpoint's own tokenizer (tokenize.tokenizer: {options.path})"
            )
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if positions is not None and field.shape[0] > positions:
            raise ValueError(
                f"{where} has {positions} positions; dataset {info.name!r}'s sequences are {field.shape[0]} tokens "
                f"long: set tokenize.seq_len to at most {positions}"
            )
    if task == "image_classification":
        if len(info.input_shape) != 3:
            raise ValueError(
                f"{where} classifies images (C, H, W); dataset {info.name!r} has inputs {info.input_shape}"
            )
        c, h, w = info.input_shape
        channels, size = getattr(config, "num_channels", c), getattr(config, "image_size", h)
        if channels != c or (size, size) != (h, w):
            raise ValueError(f"{where} takes {channels}x{size}x{size} images; dataset {info.name!r}'s are {c}x{h}x{w}")
    if task != "causal_lm" and config.num_labels != info.num_classes:
        labels = ", ".join(str(v) for v in list(config.id2label.values())[:12])
        raise ValueError(
            f"{where} has {config.num_labels} labels ({labels}); dataset {info.name!r} has {info.num_classes} classes. "
            f"Save the checkpoint with num_labels={info.num_classes} (a fresh classifier head), or pick a dataset with "
            f"its labels"
        )


class HuggingFace:
    """A Hugging Face checkpoint (causal LM, sequence or image classification), fine-tuned."""

    options_type = HuggingFaceOptions

    def build(self, options: HuggingFaceOptions, info: DatasetInfo) -> HuggingFaceModel:
        """The checkpoint's architecture with fresh weights (on the meta device when the caller
        builds there); training starts from the checkpoint's weights (`pretrained`)."""
        task = task_of(options)
        config = _config_of(options)
        _check_fits(options, task, config, info)
        hf = auto_class(task).from_config(config)
        _give_reset_parameters(hf)
        return HuggingFaceModel(_with_lora(hf, task, options.lora), task)

    def portable(self, options: HuggingFaceOptions) -> HuggingFaceOptions:
        """The options with config.json's content in them: what a registered model's spec holds,
        so that it rebuilds without the checkpoint's folder."""
        return dataclasses.replace(options, config=_config_of(options).to_dict())

    def pretrained(self, options: HuggingFaceOptions) -> str:
        """Where the weights training starts from are, unless model.init_from names others."""
        return options.path

    def tokenizer(self, options: HuggingFaceOptions) -> str:
        """The checkpoint whose tokenizer makes the ids this model reads ("" for images)."""
        return "" if task_of(options) == "image_classification" else options.path

    def from_huggingface(
        self, options: HuggingFaceOptions, info: DatasetInfo, directory: str
    ) -> dict[str, torch.Tensor]:
        """The weights of the checkpoint at `directory` (this architecture's), under this model's names."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        task = task_of(options)
        hf = auto_class(task).from_pretrained(directory, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the adapters' A starts random: the same checkpoint, the same start
            hf = _with_lora(hf, task, options.lora)
        return {PREFIX + k: v for k, v in hf.state_dict().items()}

    def merged(self, options: HuggingFaceOptions, model: HuggingFaceModel) -> tuple[HuggingFaceOptions, nn.Module]:
        """The trained model as it is kept: LoRA's adapters merged into the weights they adapt (a
        plain transformers model, served and exported without peft), and the options that build
        it; without LoRA, both as they are (decided on the options: flyscale asks with the model
        on the meta device first)."""
        if options.lora is None:
            return options, model
        hf: Any = model.hf  # a peft PeftModel
        return dataclasses.replace(options, lora=None), HuggingFaceModel(hf.merge_and_unload(), model.task)

    def huggingface(self, options: HuggingFaceOptions, info: DatasetInfo, model: HuggingFaceModel) -> tuple[dict, dict]:
        """The model as it came: its own config and its weights under its own names."""
        if not isinstance(model, HuggingFaceModel):
            raise TypeError("huggingface() takes a model built by 'huggingface'")
        hf: Any = model.hf  # a transformers PreTrainedModel
        return hf.config.to_dict(), dict(hf.state_dict())


huggingface = HuggingFace()
