"""The training strategy, chosen by name in `train.strategy`: a plugin that applies its
parallelism to the model (`ddp`, `fsdp`, `pipeline`, `hybrid`, or a third party's). What a
strategy is and may do is read here (its traits through `traits_of`), nowhere else."""

from __future__ import annotations

from typing import Any

from torch import nn

from flyscale.config import TrainConfig
from flyscale.plugin.registry import optional_method
from flyscale.plugin.strategy_protocol import StrategyTraits as StrategyTraits  # the record, for callers of this module
from flyscale.plugin.strategy_protocol import fixed_workers as fixed_workers
from flyscale.plugin.strategy_protocol import traits_of
from flyscale.train import meta, step


def strategy(cfg: TrainConfig) -> tuple[Any, Any]:
    """The configured training strategy and its parsed options."""
    return cfg.plugin.plugin, cfg.plugin.options


def parallelizes(strategy: Any) -> bool:
    """Whether `strategy` is a model transform (`parallelize`), not the older training function."""
    return optional_method("strategies", strategy, "parallelize") is not None


def replicas(strategy: Any, options: Any, world_size: int) -> int:
    """How many data-parallel replicas share the global batch of `world_size` workers: the
    strategy's `replicas(options, world_size)` where it has one (hybrid: the mesh's dp), else every
    worker (`per_worker_batch`, ddp and fsdp) or one (the pipeline, whose stages see one batch)."""
    method = optional_method("strategies", strategy, "replicas")
    if method is not None:
        return int(method(options, world_size))
    return world_size if traits_of(strategy).per_worker_batch else 1


def any_worker_count(cfg: TrainConfig) -> bool:
    """Whether the configured training computes the same model on any number of workers, given
    the same global batch (ddp, fsdp: every worker takes its share of each batch), so that
    FLYSCALE_NPROC_PER_NODE=auto may choose the count. Not a pipeline's stages or a mesh."""
    fn = cfg.plugin.plugin
    return traits_of(fn).per_worker_batch and cfg.plugin.method("replicas") is None and cfg.workers() is None


def wants_meta_model(cfg: TrainConfig) -> bool:
    """Whether the configured strategy takes its model on the meta device (`meta_model`)."""
    return traits_of(cfg.plugin.plugin).meta_model


def reshards(cfg: TrainConfig) -> bool:
    """Whether the configured strategy's checkpoints resume on another number of workers
    (`reshards`: its state is DTensors, saved through DCP)."""
    return traits_of(cfg.plugin.plugin).reshards


def per_worker_batch(cfg: TrainConfig) -> bool:
    """Whether `train.batch_size` is rows per worker under the configured strategy (else every
    worker sees the global batch: pipelining)."""
    return traits_of(cfg.plugin.plugin).per_worker_batch


def check_model(model: nn.Module, cfg: TrainConfig, world_size: int) -> None:
    """Refuse, before any data work, a model the configured training cannot train: the loop's
    own needs, then the strategy's `check` (where it has one). ValueError naming what and why."""
    if cfg.activation_checkpointing:
        step.checkpointable(model)
    if wants_meta_model(cfg):  # it will materialise the layers from the meta device
        meta.check_materialisable(model)
    check = cfg.plugin.method("check")
    if check is not None:
        check(model, cfg, cfg.plugin.options, world_size)
