"""The Protocol of a training strategy, and the traits a strategy declares (read through `traits_of`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # for the annotations only: configs and the plugin registry load without torch (3 s)
    from torch import nn


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy is, as the trainer, the preflight and the launcher need to know it: one
    record a strategy declares as its `traits` attribute, read through `traits_of`."""

    # train.batch_size rows per worker, the global batch that times the workers; False when every
    # worker sees the same global batch (pipelining).
    per_worker_batch: bool = True
    # The model arrives on the meta device: the strategy materialises only this rank's part.
    meta_model: bool = False
    # Its checkpoints (DTensors, through DCP) resume on another number of workers, the global
    # batch kept; the restart directory is then keyed without the worker count.
    reshards: bool = False


def traits_of(strategy: Any) -> StrategyTraits:
    """`strategy`'s traits: its `traits` record, or the defaults. A package written against no
    flyscale may give any object of the same fields, and one written before the record set them
    as loose attributes of the strategy: both are read here, and nowhere else."""
    declared = getattr(strategy, "traits", None)
    if isinstance(declared, StrategyTraits):
        return declared
    source = strategy if declared is None else declared
    names = [f for f in StrategyTraits.__dataclass_fields__ if hasattr(source, f)]
    return StrategyTraits(**{name: bool(getattr(source, name)) for name in names})


def fixed_workers(strategy: Any, options: Any) -> int | None:
    """The number of workers `options` fix, for a strategy with `workers(options)` (hybrid's
    mesh); None where the launcher decides. (Here, below config, which asks it.)"""
    method = getattr(strategy, "workers", None)
    return method(options) if method is not None else None


class StrategyPlugin(Protocol):
    """A model transform: `parallelize` applies the parallelism to `model` on this rank and says,
    in a `flyscale.api.Parallelized`, what the trainer needs to train it (the module to step and
    checkpoint, the evaluator, a step of its own where the standard one does not do, the
    collectives' clock, the loader where it differs, how rank 0 gets the whole model back). The
    trainer (`flyscale.api.train`) owns the rest: optimizer, scheduler, step, epochs, checkpoints.

    Optional attribute `traits` (flyscale.api.StrategyTraits; default: its defaults):
    `per_worker_batch`, `meta_model`, `reshards`.
    Optional method `check(model, cfg, options, world_size)`: raise ValueError, naming the layer
    or setting and the way out, for a model (built on the meta device) or a config this strategy
    cannot train at that world size. It runs before any data is read.
    Optional method `replicas(options, world_size)`: how many data-parallel replicas share the
    global batch, where that is neither every worker nor one (hybrid: the mesh's dp).
    Optional method `workers(options)`: the number of workers these options fix (hybrid's mesh),
    or None; a local run starts that many.

    The older form, a callable `(model, data, cfg, ctx, options, hooks)` that trains by itself
    and returns a TrainResult, is still run as it is (passing `hooks` on to `fit`).
    """

    # data: flyscale.api.TrainData, cfg: TrainConfig, ctx: DistContext; returns a Parallelized.
    # (Those live with the training loop, which is built on config, which is built on this module.)
    def parallelize(self, model: nn.Module, data: Any, cfg: Any, ctx: Any, options: Any) -> Any: ...
