"""Typed configuration: one dataclass per stage, grouped in `PipelineConfig`.

These are the workflow's inputs. `pyflyte run ... --cfg configs/x.yaml` loads a YAML preset
into `PipelineConfig`; every field has a working default, so a preset only names what it
changes. Each `__post_init__` fails with a ValueError that names the field, so bad config
stops the run before any data is loaded or any worker is started. An unknown key is an error
on every way in (keyword arguments, `from_dict`, and the mapping pyflyte decodes for `--cfg`),
with the nearest name suggested.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Callable

from mashumaro.codecs.basic import BasicDecoder

from flyscale.registry import Resolved, resolve
from flyscale.strict import ConfigError, check_keys, innermost_value_error


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{_section(obj)}.{name} must be > 0, got {getattr(obj, name)!r}")


def _fraction(obj: Any, name: str, *, lo: float = 0.0, hi: float = 1.0) -> None:
    value = getattr(obj, name)
    if not lo <= value <= hi:
        raise ValueError(f"{_section(obj)}.{name} must be in [{lo}, {hi}], got {value!r}")


def _section(obj: Any) -> str:
    return getattr(obj, "_section", type(obj).__name__)


class _StrictConstruction(type):
    """Keyword arguments a section does not have are refused with the nearest field's name,
    instead of the dataclass __init__'s bare TypeError."""

    def __call__(cls, *args, **kwargs):
        if dataclasses.is_dataclass(cls):
            check_keys(cls._section, kwargs, [f.name for f in fields(cls)], cls._what)
        return super().__call__(*args, **kwargs)


class _Section(metaclass=_StrictConstruction):
    """A config section. Sections that name a plugin resolve it once, when they are built
    (validation and every later use share the result); the resolution never travels in a pickle,
    so a worker process resolves through its own registry."""

    _section = ""
    _what = "field"

    @classmethod
    def check_mapping(cls, data: Any) -> None:
        """Refuse unknown keys in a mapping meant for this section (and for its sections)."""
        if not isinstance(data, dict):
            return  # a type mismatch is the decoder's to report
        known = {f.name: f for f in fields(cls)}
        check_keys(cls._section, data, known, cls._what)
        for key, value in data.items():
            sub = _SECTIONS.get(known[key].type)
            if sub is not None:
                sub.check_mapping(value)

    @classmethod
    def __pre_deserialize__(cls, data: Any) -> Any:
        # mashumaro (flytekit's decoder of dataclass literals) calls this with the raw mapping
        # before it would silently drop the keys it does not know.
        cls.check_mapping(data)
        return data

    @classmethod
    def from_json(cls, text: str):
        """The section from JSON, strictly. `pyflyte run --cfg` (YAML or JSON) builds the workflow
        input through this method when the class has one, and otherwise through dataclasses_json,
        which drops unknown keys without a word."""
        try:
            return BasicDecoder(cls).decode(json.loads(text))
        except ValueError as exc:
            raise ConfigError(str(innermost_value_error(exc))) from None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_resolved"}

    def _resolved_once(self, key: Any, resolve_fn: Callable[[], Any]) -> Any:
        # Keyed on the fields it came from, so a section edited after it was built resolves again.
        cached = self.__dict__.get("_resolved")
        if cached is None or cached[0] != key:
            cached = (key, resolve_fn())
            self.__dict__["_resolved"] = cached
        return cached[1]

    def _plugin(self, kind: str, name_field: str) -> Resolved:
        name, options, sec = getattr(self, name_field), self.options, _section(self)  # type: ignore[attr-defined]
        return self._resolved_once(
            (name, repr(options)), lambda: resolve(kind, name, options, f"{sec}.{name_field}", f"{sec}.options")
        )


@dataclass
class DataConfig(_Section):
    """Which dataset to load and how to split it."""

    _section = "data"
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

    def __post_init__(self):
        self.plugin  # noqa: B018 (resolving is the validation: an unknown name or bad option fails here)
        _fraction(self, "val_fraction", lo=0.01, hi=0.5)
        _fraction(self, "test_fraction", lo=0.01, hi=0.5)
        _fraction(self, "max_quarantine_fraction")
        if self.max_drift_psi < 0:
            raise ValueError(f"data.max_drift_psi must be >= 0 (0 = report only), got {self.max_drift_psi}")

    @property
    def plugin(self) -> Resolved:
        """The dataset plugin and its parsed options."""
        return self._plugin("datasets", "dataset")


@dataclass
class AugmentConfig(_Section):
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
        if self.names is None:
            # Which augmentations run is not known yet, but options given for one must fit it.
            for name, options in self.options.items():
                resolve("augmentations", name, options, f"augment.options.{name}", f"augment.options.{name}")
        else:
            for name in self.options:
                if name not in self.names:
                    raise ValueError(f"augment.options.{name}: {name!r} is not listed in augment.names {self.names}")
        self.plugins  # noqa: B018 (resolving is the validation)

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


@dataclass
class ModelConfig(_Section):
    """Which model to build; `options` go to the model plugin's own options dataclass."""

    _section = "model"
    name: str = "mlp"
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        self.plugin  # noqa: B018 (resolving is the validation)

    @property
    def plugin(self) -> Resolved:
        """The model plugin and its parsed options."""
        return self._plugin("models", "name")


@dataclass
class TrainConfig(_Section):
    """Optimisation and parallelism. `batch_size` is per worker per optimizer step."""

    _section = "train"
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

    def __post_init__(self):
        self.plugin  # noqa: B018 (resolving is the validation)
        _positive(self, "epochs", "batch_size", "lr", "grad_accum_steps", "base_batch_size", "prefetch_factor")
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

    @property
    def plugin(self) -> Resolved:
        """The training strategy and its parsed options."""
        return self._plugin("strategies", "strategy")


@dataclass
class RecoveryConfig(_Section):
    """Surviving dead workers and preemption: checkpoints, resume, and how long to wait for a peer.

    Nothing here changes the model, so none of it is part of training's cache key.
    """

    _section = "recovery"
    checkpoint_every_steps: int = 0  # a checkpoint every N optimizer steps; 0 = by time only
    checkpoint_every_minutes: float = 5.0  # and one every M minutes of training; 0 = by steps only
    keep_checkpoints: int = 2  # the newest K are kept in the restart directory
    # The local restart directory; checkpoints go in a folder per run under it. "" = ~/.flyscale/checkpoints.
    # On a multi-node cluster make it a volume every node mounts.
    checkpoint_dir: str = ""
    resume: bool = True  # resume from the newest checkpoint of this run when one exists
    # A collective that waits longer than this for a peer fails, naming the lost rank: a dead or
    # stopped worker is an error in seconds, not NCCL's hours. Raise it for slow first steps.
    collective_timeout_s: float = 120.0

    def __post_init__(self):
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_minutes < 0:
            raise ValueError("recovery.checkpoint_every_steps and recovery.checkpoint_every_minutes must be >= 0")
        _positive(self, "keep_checkpoints", "collective_timeout_s")


@dataclass
class PreflightConfig(_Section):
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
        _positive(self, "steps", "rtol")
        if self.rtol >= 1:
            raise ValueError(f"preflight.rtol must be < 1 (a relative tolerance), got {self.rtol!r}")


@dataclass
class GateConfig(_Section):
    """One evaluation gate: a gate plugin and its options."""

    _section = "gate"
    name: str = "min_metric"
    options: dict = field(default_factory=dict)  # the gate's own; its defaults live in its options dataclass

    def __post_init__(self):
        self.plugin  # noqa: B018 (resolving is the validation)

    @property
    def plugin(self) -> Resolved:
        """The gate plugin and its parsed options."""
        return self._plugin("gates", "name")


def _default_gates() -> list[GateConfig]:
    return [GateConfig("min_metric"), GateConfig("quantization")]


@dataclass
class GatesConfig(_Section):
    """Every gate a model must pass before it is published; each verdict is recorded.

    In YAML `gate:` is a list of gates (`- {name: min_metric}`), or one gate as a mapping
    (`gate: {name: beats_champion}`), which is a list of one.
    """

    _section = "gate"
    gates: list[GateConfig] = field(default_factory=_default_gates)

    def __post_init__(self):
        names = [g.name for g in self.gates]
        if len(set(names)) != len(names):
            raise ValueError(f"gate: a gate is listed twice in {names}; give each once, with all its options")

    @staticmethod
    def normalise(data: Any) -> Any:
        """A list of gates, or one gate's mapping, as the {"gates": [...]} this section holds."""
        if isinstance(data, list):
            return {"gates": data}
        if isinstance(data, dict) and "gates" not in data:
            return {"gates": [data]}
        return data

    @classmethod
    def check_mapping(cls, data: Any) -> None:
        data = cls.normalise(data)
        if isinstance(data, dict):
            check_keys(cls._section, data, ["gates"], cls._what)
            for gate in data.get("gates") or []:
                GateConfig.check_mapping(gate)

    @classmethod
    def __pre_deserialize__(cls, data: Any) -> Any:
        cls.check_mapping(data)
        return cls.normalise(data)

    @classmethod
    def from_value(cls, data: Any) -> "GatesConfig":
        """The section from what a YAML preset holds under `gate:`."""
        data = cls.normalise(data or {})
        cls.check_mapping(data)
        gates = data.get("gates")
        return cls() if gates is None else cls(gates=[g if isinstance(g, GateConfig) else GateConfig(**g) for g in gates])


@dataclass
class QuantizeConfig(_Section):
    """Post-training quantization: which quantizer, with which options."""

    _section = "quantize"
    name: str = "dynamic_int8"
    options: dict = field(default_factory=dict)
    # How much accuracy int8 may cost is the `quantization` gate's: gate: [..., {name: quantization,
    # options: {max_accuracy_drop: 0.01}}].

    def __post_init__(self):
        self.plugin  # noqa: B018 (resolving is the validation)

    @property
    def plugin(self) -> Resolved:
        """The quantizer plugin and its parsed options."""
        return self._plugin("quantizers", "name")


@dataclass
class MlflowConfig(_Section):
    """Where runs and models go. The tracking URI comes from MLFLOW_TRACKING_URI, else ./mlflow.db."""

    _section = "mlflow"
    experiment: str = "flyscale"
    model_name: str = "flyscale-digits"
    alias: str = "champion"
    # "auto": a model that passes every gate becomes `alias` (compare-and-set). "manual": it becomes
    # `challenger_alias`, and a person moves `alias` with `flyscale promote` after looking.
    promotion: str = "auto"
    challenger_alias: str = "challenger"
    # Every MLflow request is retried this many times with exponential backoff (factor in
    # seconds) before the run fails with a retryable error; MLflow's own default is ~4 minutes.
    retries: int = 3
    retry_backoff_s: int = 1
    request_timeout_s: int = 30
    lock_timeout_s: float = 120.0  # how long to wait for another run that is moving the alias
    lock_stale_s: float = 600.0  # a promotion lock older than this was left by a dead run

    def __post_init__(self):
        for name in ("experiment", "model_name", "alias", "challenger_alias"):
            if not getattr(self, name).strip():
                raise ValueError(f"mlflow.{name} must not be empty")
        if self.promotion not in ("auto", "manual"):
            raise ValueError(f"mlflow.promotion must be 'auto' or 'manual', got {self.promotion!r}")
        if self.challenger_alias == self.alias:
            raise ValueError(f"mlflow.challenger_alias must differ from mlflow.alias ({self.alias!r})")
        if self.retries < 0:
            raise ValueError(f"mlflow.retries must be >= 0, got {self.retries}")
        _positive(self, "retry_backoff_s", "request_timeout_s", "lock_timeout_s", "lock_stale_s")


@dataclass
class PipelineConfig(_Section):
    """Everything one run of `training_pipeline` needs."""

    _what = "config section"

    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    gate: GatesConfig = field(default_factory=GatesConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def __post_init__(self):
        if self.augment.names is None:
            # Generic config holds no plugin's defaults: the dataset says what fits its data.
            names = list(self.data.plugin.attribute("default_augmentations"))
            try:
                self.augment = dataclasses.replace(self.augment, names=names)
            except ValueError as exc:
                raise ValueError(f"{exc} (augment.names is unset, so it is dataset {self.data.dataset!r}'s "
                                 f"default_augmentations {names})") from None
        if self.data.plugin.attribute("streaming") and self.augment.names and self.augment.copies:
            # Streamed data is prepared in one pass with no augment stage: say so rather than ignore it.
            raise ValueError(
                f"augment.names: dataset {self.data.dataset!r} streams data larger than memory, which is not "
                f"augmented (copies would multiply it); set augment.names: [] or use its in-memory twin"
            )


def effective(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as a nested dict, each plugin's options filled in with the plugin's defaults."""
    out = asdict(cfg)
    for section in ("data", "model", "train", "quantize"):
        options = getattr(cfg, section).plugin.options
        out[section]["options"] = asdict(options) if options is not None else {}
    out["gate"]["gates"] = [
        {"name": g.name, "options": asdict(g.plugin.options) if g.plugin.options is not None else {}}
        for g in cfg.gate.gates
    ]
    out["augment"]["options"] = {r.name: asdict(r.options) for r in cfg.augment.plugins if r.options is not None}
    return out


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """`{"train.lr": 0.002, ...}`: the shape MLflow params and the compare view want.

    A PipelineConfig is flattened as `effective` gives it, so a plugin default shows as a param.
    """
    out: dict[str, Any] = {}
    if isinstance(cfg, PipelineConfig):
        cfg = effective(cfg)
    items = asdict(cfg).items() if is_dataclass(cfg) else cfg.items()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))  # an empty one adds no name: {} is not a value
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out.update(flatten({str(i): v for i, v in enumerate(value)}, f"{name}."))  # gate.gates.0.name
        else:
            out[name] = value
    return out


# Field type (a string under `from __future__ import annotations`) -> section class.
_SECTIONS = {
    c.__name__: c
    for c in (DataConfig, AugmentConfig, ModelConfig, TrainConfig, PreflightConfig, RecoveryConfig, GatesConfig,
              QuantizeConfig, MlflowConfig)
}


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    """Build a validated PipelineConfig from a (YAML) mapping; unknown keys are errors."""
    data = data or {}
    PipelineConfig.check_mapping(data)
    types = {f.name: f.type for f in fields(PipelineConfig)}
    def build(section: type, value: Any) -> Any:
        return section.from_value(value) if hasattr(section, "from_value") else section(**(value or {}))

    return PipelineConfig(**{key: build(_SECTIONS[types[key]], value) for key, value in data.items()})
