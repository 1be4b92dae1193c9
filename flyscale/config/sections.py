"""The sections for data and training: one per stage, each a strict pydantic dataclass.

Every field has a working default, so a preset names only what it changes. Types are checked
strictly on every way in (flyscale/config/strict.py); each `__post_init__` checks what a type
cannot say (ranges, a plugin's name and options) with a ValueError that names the field. The
sections for gates and publishing are in `publishing`, and the whole run's in `pipeline`.
"""

from __future__ import annotations

import re
from dataclasses import field

from flyscale.config.base import Section, fraction, positive, section
from flyscale.config.plugins import PluginSection, canonical, resolve
from flyscale.plugin.data_kind import DataKind, declared_kind
from flyscale.plugin.registry import Resolved
from flyscale.plugin.strategy_protocol import fixed_workers

# What model.init_from may name: a registered version (by alias or number) or a run's model.
START_URI = re.compile(r"models:/[^/@]+(@[\w.-]+|/\d+)|runs:/[0-9a-f]+(/[\w.-]+)?")


@section
class DataConfig(PluginSection):
    """Which dataset to load and how to split it."""

    _section = "data"
    _kind = "datasets"
    _name_field = "dataset"
    dataset: str = "digits"
    options: dict = field(default_factory=dict)  # the dataset plugin's own options
    val_fraction: float = 0.15
    test_fraction: float = 0.2
    seed: int = 0
    max_quarantine_fraction: float = 0.05  # more bad rows than this fails validation
    # Drift (PSI per feature and for the labels) against the reference is always measured and
    # reported; above this it fails the run (0: report only). 0.25 is the usual "significant shift".
    max_drift_psi: float = 0.0
    # A reference profile (JSON, as flyscale records it with each model) to validate against
    # instead of the champion's; empty: the champion's, when there is one.
    reference: str = ""
    # Typed examples (images, text) only. Training streams the splits' row groups instead of
    # reading them into memory (data larger than memory); a table streams with parquet_stream or
    # csv_stream, which set it.
    streaming: bool = False
    # Typed examples only: the splits keep encoded images (PNG, JPEG) as they came, and the loader
    # decodes them, in its worker processes when training streams: a fraction of the disk for
    # JPEGs, at the cost of decoding every epoch. Off: decoded once, when validated.
    keep_encoded: bool = False

    def __post_init__(self):
        self._canonical()  # resolving is the validation: an unknown name or a bad option fails here
        fraction(self, "val_fraction", lo=0.01, hi=0.5)
        fraction(self, "test_fraction", lo=0.01, hi=0.5)
        fraction(self, "max_quarantine_fraction")
        if self.max_drift_psi < 0:
            raise ValueError(f"data.max_drift_psi must be >= 0 (0 = report only), got {self.max_drift_psi}")
        kind = declared_kind(self.plugin)
        if kind is DataKind.TABLE_STREAM:
            self.streaming = True  # what such a dataset is for: training never reads its splits whole
        # A streamed table streams; nothing else of a table does.
        refused = {"streaming": kind is DataKind.TABLE, "keep_encoded": kind.is_table}
        for name, is_refused in refused.items():
            if getattr(self, name) and is_refused:
                raise ValueError(
                    f"data.{name} is for datasets of typed examples (images, text); {self.dataset!r} is a table"
                    + (": stream a table with parquet_stream or csv_stream" if name == "streaming" else "")
                )


@section
class AugmentConfig(Section):
    """Augmentations applied to the training split only."""

    _section = "augment"
    # Applied in order. Unset (None): the dataset's own `default_augmentations`, filled in by
    # PipelineConfig, since what fits images does not fit tabular rows. [] turns augmentation off.
    names: list[str] | None = None
    copies: int = 1  # augmented copies per training row, added beside the originals
    options: dict = field(default_factory=dict)  # per-augmentation options
    seed: int = 0

    def __post_init__(self):
        if self.copies < 0:
            raise ValueError(f"augment.copies must be >= 0, got {self.copies}")
        if self.names is not None:
            for name in self.options:
                if name not in self.names:
                    raise ValueError(f"augment.options.{name}: {name!r} is not listed in augment.names {self.names}")
        # Which augmentations run may not be known yet (names unset), but options given for one must fit it.
        parsed = {
            name: resolve("augmentations", name, options, f"augment.options.{name}", f"augment.options.{name}").options
            for name, options in self.options.items()
        }
        self.options = {name: kept for name, p in parsed.items() if (kept := canonical(p))}
        self.plugins  # noqa: B018  # resolving the names is their validation

    @property
    def plugins(self) -> list[Resolved]:
        """Each augmentation, in order, with its parsed options ([] while `names` is unset)."""
        names, options = list(self.names or []), self.options
        return self._resolved_once(
            (tuple(names), repr(options)),
            lambda: [
                resolve("augmentations", n, options.get(n), "augment.names", f"augment.options.{n}") for n in names
            ],
        )


@section
class TokenizeConfig(Section):
    """How documents become token sequences (text datasets only): a tokenizer, then each split's
    documents laid end to end, each closed by an end-of-text token, cut into sequences of
    `seq_len` tokens. The split is by document, before packing, so no sequence spans two splits."""

    _section = "tokenize"
    # "byte": UTF-8 bytes (257 ids); "bpe": a byte-level BPE trained on the training split; anything
    # else names a Hugging Face checkpoint (its folder, or a hub id where online) whose own tokenizer
    # is used: the one a pretrained model's embedding reads (model: huggingface needs it).
    tokenizer: str = "byte"
    vocab_size: int = 2048  # bpe: ids in the trained vocabulary, the byte alphabet and <|endoftext|> included
    min_frequency: int = 2  # bpe: a pair merges only if it occurs at least this often
    seq_len: int = 128  # tokens per packed sequence

    def __post_init__(self):
        if not self.tokenizer.strip():
            raise ValueError("tokenize.tokenizer must be 'byte', 'bpe' or a Hugging Face checkpoint's folder, got ''")
        positive(self, "min_frequency")
        if self.seq_len < 2:
            raise ValueError(f"tokenize.seq_len must be >= 2 (an input and the token after it), got {self.seq_len}")
        if self.tokenizer == "bpe" and self.vocab_size <= 257:
            raise ValueError(
                f"tokenize.vocab_size must be > 257 (the 256 bytes and <|endoftext|>) for 'bpe', got {self.vocab_size}"
            )


@section
class ModelConfig(PluginSection):
    """Which model to build; `options` go to the model plugin's own options dataclass."""

    _section = "model"
    _kind = "models"
    name: str = "mlp"
    options: dict = field(default_factory=dict)
    # Start training from these weights instead of fresh ones (a warm start, a fine-tune):
    # models:/NAME@ALIAS, models:/NAME/VERSION, or runs:/RUN_ID (that run's model); or a Hugging
    # Face checkpoint (a folder, or a hub id where online) that the model plugin reads
    # (from_huggingface). "" = fresh weights, or the pretrained checkpoint the model starts from.
    init_from: str = ""

    def __post_init__(self):
        self._canonical()  # resolving is the validation: an unknown name or a bad option fails here
        if self.init_from and not START_URI.fullmatch(self.init_from) and re.match(r"\w+:/", self.init_from):
            raise ValueError(
                f"model.init_from must be models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID[/MODEL] or a "
                f"Hugging Face checkpoint (a folder, or a hub id where online), got {self.init_from!r}"
            )


@section
class ObjectiveConfig(PluginSection):
    """What training optimises, validation and evaluation measure, the gates see and the served
    model returns: an objective plugin (classification, regression, language_modeling) by name."""

    _section = "objective"
    _kind = "objectives"
    name: str = "classification"
    options: dict = field(default_factory=dict)  # the objective's own options

    def __post_init__(self):
        self._canonical()  # resolving is the validation: an unknown name or a bad option fails here


# Validation metrics early stopping can watch, and whether lower is better.
STOPPING_METRICS = {"val_loss": True, "val_accuracy": False}


@section
class EarlyStoppingConfig(Section):
    """Stop training once the validation metric has not improved for `patience` epochs, and hand
    on the best epoch's weights, not the last."""

    _section = "train.early_stopping"
    metric: str = "val_loss"  # "val_loss" (lower is better) or "val_accuracy" (higher is better)
    patience: int = 3  # epochs in a row without an improvement before training stops
    min_delta: float = 0.0  # an epoch improves on the best only by more than this

    def __post_init__(self):
        if self.metric not in STOPPING_METRICS:
            raise ValueError(
                f"train.early_stopping.metric must be one of {sorted(STOPPING_METRICS)}, got {self.metric!r}"
            )
        positive(self, "patience")
        if self.min_delta < 0:
            raise ValueError(f"train.early_stopping.min_delta must be >= 0, got {self.min_delta}")

    def improves(self, value: float, best: float) -> bool:
        """Whether `value` beats `best` by more than min_delta, in the metric's direction."""
        return value < best - self.min_delta if STOPPING_METRICS[self.metric] else value > best + self.min_delta


@section
class TrainConfig(PluginSection):
    """Optimisation and parallelism. `batch_size` is per worker per optimizer step."""

    _section = "train"
    _kind = "strategies"
    _name_field = "strategy"
    strategy: str = "ddp"
    epochs: int = 30
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    options: dict = field(default_factory=dict)  # the strategy's own options
    # Techniques: each is off by default and switched on here, never in code.
    grad_accum_steps: int = 1  # split each batch into this many micro-batches (same math, less memory)
    precision: str = "fp32"  # "bf16" (autocast; CPU or CUDA) or "fp16" (CUDA, with GradScaler)
    activation_checkpointing: bool = False  # recompute activations in backward instead of storing them
    grad_clip_norm: float = 0.0  # clip the global gradient norm to this; 0 = off
    scale_lr: bool = False  # linear scaling rule: lr x global_batch / base_batch_size
    base_batch_size: int = 32  # the global batch `lr` was tuned for
    warmup_epochs: float = 0.0  # linear warm-up from 0 to the (scaled) lr
    num_workers: int = 0  # DataLoader worker processes per rank
    pin_memory: bool = True  # page-locked host memory, used only when training on CUDA
    persistent_workers: bool = False  # keep DataLoader workers alive between epochs
    prefetch_factor: int = 2  # batches each DataLoader worker loads ahead
    # Training-set accuracy costs three small kernels per step (~4% of a tiny MLP's step on CPU);
    # validation accuracy is always measured, so this is off unless asked for.
    track_train_accuracy: bool = False
    # Stop when the validation metric stops improving, and keep the best epoch's weights; None: train
    # every epoch and hand on the last.
    early_stopping: EarlyStoppingConfig | None = None

    def __post_init__(self):
        self._canonical()  # resolving is the validation: an unknown name or a bad option fails here
        positive(self, "epochs", "batch_size", "lr", "grad_accum_steps", "base_batch_size", "prefetch_factor")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(
                f"train.grad_accum_steps ({self.grad_accum_steps}) must divide train.batch_size ({self.batch_size})"
            )
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"train.precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if self.grad_clip_norm < 0 or self.warmup_epochs < 0 or self.num_workers < 0:
            raise ValueError("train.grad_clip_norm, train.warmup_epochs and train.num_workers must be >= 0")
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("train.persistent_workers needs train.num_workers > 0")

    def workers(self) -> int | None:
        """The number of workers this config asks for, where its strategy fixes one (hybrid's
        mesh, `workers(options)`); None where the launcher decides."""
        return fixed_workers(self.plugin.plugin, self.plugin.options)


@section
class RecoveryConfig(Section):
    """Surviving dead workers and preemption: checkpoints, resume, and how long to wait for a peer.

    Nothing here changes the model, so none of it is part of training's cache key.
    """

    _section = "recovery"
    checkpoint_every_steps: int = 0  # a checkpoint every N optimizer steps; 0 = by time only
    # And one every M minutes of training; 0 = by steps only. Unset (null): a tenth of the run,
    # between 30 s and 5 minutes, so that a run of a few minutes has checkpoints too.
    checkpoint_every_minutes: float | None = None
    keep_checkpoints: int = 2  # the newest K are kept in the restart directory
    # DCP writes the tensors from a background thread while training goes on (a copy in host
    # memory meanwhile); false: training waits for each checkpoint to be written.
    async_checkpoints: bool = True
    # The local restart directory; checkpoints go in a folder per run under it. "" = ~/.flyscale/checkpoints.
    # On more than one node: one volume (ReadWriteMany) at this path in every training pod; a job
    # whose ranks do not all see it is refused before training (train/shared_disk.py).
    checkpoint_dir: str = ""
    resume: bool = True  # resume from the newest checkpoint of this training (a restart, a retry, a rerun)
    # A checkpoint to resume from instead (a step-* directory, or a run directory: its newest),
    # e.g. one a run that was stopped left behind. `flyscale checkpoints` lists them.
    resume_from: str = ""
    # Run directories under checkpoint_dir untouched for longer than this are deleted when a
    # training starts (a finished run deletes its own at once); 0 keeps them for ever.
    retention_days: float = 7.0
    # A collective that waits longer than this for a peer fails, naming the lost rank: a dead or
    # stopped worker is an error in seconds, not NCCL's hours. Raise it for slow first steps.
    collective_timeout_s: float = 120.0

    def __post_init__(self):
        minutes = self.checkpoint_every_minutes
        if self.checkpoint_every_steps < 0 or (minutes is not None and minutes < 0):
            raise ValueError(
                "recovery.checkpoint_every_steps and recovery.checkpoint_every_minutes must be >= 0 "
                "(checkpoint_every_minutes unset: an interval that scales with the run)"
            )
        positive(self, "keep_checkpoints", "collective_timeout_s")
        if self.retention_days < 0:
            raise ValueError(f"recovery.retention_days must be >= 0 (0 = keep for ever), got {self.retention_days}")

    def checkpoints(self) -> bool:
        """Whether training checkpoints at all (by steps, by time, or on the scaled interval)."""
        return bool(self.checkpoint_every_steps) or self.checkpoint_every_minutes != 0


@section
class PreflightConfig(Section):
    """A few optimizer steps at world size 1 and at world size N before training; off by default.

    The two runs see the same global batches from the same initial weights, so their losses
    agree to float rounding when sharding, LR scaling and gradient sync are right.
    """

    _section = "preflight"
    enabled: bool = False
    steps: int = 5  # optimizer steps compared; each step's loss and the loss after it
    # fp32 runs agree to ~1e-6; real faults move the loss by 1e-2 or more. Loosen for bf16/fp16.
    rtol: float = 1e-3

    def __post_init__(self):
        positive(self, "steps", "rtol")
        if self.rtol >= 1:
            raise ValueError(f"preflight.rtol must be < 1 (a relative tolerance), got {self.rtol!r}")
