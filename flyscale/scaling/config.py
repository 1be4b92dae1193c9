"""What a scaling study sweeps and the thresholds its recommendations are judged by: a
pipeline config (the study's base point) plus a `scaling:` section."""

from __future__ import annotations

from dataclasses import field, fields

from flyscale.config import AugmentConfig, ModelConfig, PipelineConfig
from flyscale.config.base import Section, fraction, section
from flyscale.plugin.data_kind import DataKind, declared_kind

WIDTH, DEPTH = "width_multiplier", "depth_multiplier"  # the model options a plugin declares to be swept


@section
class ScalingConfig(Section):
    """What a study sweeps, and the thresholds its recommendations are judged by.

    The base point (every training row, multipliers 1, `base_workers`) is on every axis whether
    listed or not. An empty list leaves that axis out.
    """

    _section = "scaling"
    data_fractions: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 1.0])
    width_multipliers: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    depth_multipliers: list[float] = field(default_factory=list)
    workers: list[int] = field(default_factory=lambda: [1, 2])
    base_workers: int = 1  # the worker count of the data and model points
    # Every worker gets the same share, so n workers have n times the resources of one (as on a
    # cluster, where each has its own GPU) and efficiency measures the parallelism, not contention
    # for cores: 2 threads on a 2-core machine shared with anything else ran ~8x slower, in bursts.
    threads_per_worker: int = 1
    seed: int = 0  # the permutation whose prefixes are the nested subsets
    tolerance: float = 0.01  # the knee: the smallest size whose val error is within this of the best
    min_gain: float = 0.005  # a doubling that lowers val error by less than this no longer pays
    max_gap: float = 0.05  # train minus val accuracy above this is over-fitting: more data helps
    min_efficiency: float = 0.7  # parallel efficiency under this: that many workers do not pay
    experiment: str = "flyscale-scaling"  # the MLflow experiment of the parent run and its points

    def __post_init__(self):
        for name in ("data_fractions", "width_multipliers", "depth_multipliers", "workers"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"scaling.{name} lists a value twice: {values}")
        if any(not 0.0 < f <= 1.0 for f in self.data_fractions):
            raise ValueError(f"scaling.data_fractions must each be in (0, 1], got {self.data_fractions}")
        for name in ("width_multipliers", "depth_multipliers"):
            if any(m <= 0 for m in getattr(self, name)):
                raise ValueError(f"scaling.{name} must each be > 0 (1 = the base model), got {getattr(self, name)}")
        if any(n < 1 for n in self.workers) or self.base_workers < 1 or self.threads_per_worker < 1:
            raise ValueError(
                f"scaling.workers, scaling.base_workers and scaling.threads_per_worker must be >= 1, "
                f"got {self.workers}, {self.base_workers} and {self.threads_per_worker}"
            )
        if not (self.data_fractions or self.width_multipliers or self.depth_multipliers or self.workers):
            raise ValueError(
                "scaling: nothing to sweep; list scaling.data_fractions, scaling.width_multipliers, "
                "scaling.depth_multipliers or scaling.workers"
            )
        for name in ("tolerance", "min_gain", "max_gap"):
            fraction(self, name)
        fraction(self, "min_efficiency", lo=0.01)
        if not self.experiment.strip():
            raise ValueError("scaling.experiment must not be empty")


@section
class StudyConfig(PipelineConfig):
    """A pipeline config, which is the study's base point, and the sweep around it: a preset is
    any pipeline preset plus a `scaling:` section."""

    scaling: ScalingConfig = field(default_factory=ScalingConfig)

    def __post_init__(self):
        super().__post_init__()
        if declared_kind(self.data.plugin) is DataKind.TABLE_STREAM:
            raise ValueError(
                f"data.dataset: {self.data.dataset!r} streams data larger than memory, and a scaling "
                f"study subsets the training split in memory; use its in-memory twin"
            )
        for name, option in (("width_multipliers", WIDTH), ("depth_multipliers", DEPTH)):
            for value in getattr(self.scaling, name):
                point_model(self.model, option, value, f"scaling.{name}")  # an unbuildable size fails now

    def data_pipeline(self) -> PipelineConfig:
        """The config the pipeline's data branch prepares the study's data with: the base point's,
        without a table's augmented copies. The study augments each subset itself, so its data
        axis counts rows before augmentation (typed examples are augmented as batches are drawn)."""
        sections = {f.name: getattr(self, f.name) for f in fields(PipelineConfig)}
        return PipelineConfig(**{**sections, "augment": AugmentConfig(names=[], copies=0)})


def point_model(base: ModelConfig, option: str, multiplier: float, where: str = "") -> ModelConfig:
    """The base model config with `option` (width or depth multiplier) times `multiplier`."""
    declared = [f.name for f in fields(base.plugin.options)] if base.plugin.options is not None else []
    if option not in declared:
        raise ValueError(
            f"{where or option}: model {base.name!r} declares no {option} option (its options: "
            f"{', '.join(declared) or 'none'}); sweep a model whose plugin declares one, e.g. mlp or cnn"
        )
    value = getattr(base.plugin.options, option) * multiplier
    try:
        return ModelConfig(name=base.name, options={**base.options, option: value})
    except ValueError as exc:
        raise ValueError(f"{where or option}: multiplier {multiplier:g} gives an unusable model: {exc}") from None
