"""Sharded data parallelism (ZeRO-3) with PyTorch's FSDP2 (`fully_shard`), as torchtitan applies it.

Every rank holds 1/world of each parameter, of its gradient and of its optimizer state. Before
a unit (a transformer block, or whichever modules are configured) runs forward or backward its
parameters are all-gathered, and after backward its gradients are reduce-scattered, so each rank
updates only its own shard.

The model arrives on the meta device. It is sharded first, then each rank gives storage to its
own shards only, and fills them from the same per-layer seeds every strategy uses
(`flyscale.train.meta`): one whole layer at a time is drawn on the CPU and each rank keeps its
slice of it. One process with the same seed therefore starts from the same weights.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.plugin.strategy_protocol import StrategyTraits
from flyscale.train import meta, step
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.objective import scored
from flyscale.train.telemetry import InFlight
from flyscale.train.trainer import Parallelized

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class FSDPOptions:
    # Module class names sharded as one unit each (e.g. [Block]). Empty: every layer of the
    # model's nn.Sequential that holds parameters no other layer shares (a GPT's blocks, an MLP's
    # Linear layers); what is left (a tied embedding and head) is sharded with the root.
    units: list[str] = field(default_factory=list)
    # True: ZeRO-3, parameters gathered again in backward (least memory). False: a unit keeps its
    # gathered parameters from forward to backward (ZeRO-2's memory, one all-gather fewer).
    reshard_after_forward: bool = True
    # Mixed precision: the dtype parameters are gathered and computed in, and the one gradients
    # are reduced in. bf16 pays on CUDA; on CPU it is a correctness path only.
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    # Shards, gradients and optimizer state live in host memory and stream to the GPU (CUDA only).
    cpu_offload: bool = False
    # Time every all-gather and reduce-scatter (grad_comm_fraction in MLflow, and the
    # communication-bound diagnosis); a Python callback per collective.
    time_comm: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")


def units_of(model: nn.Module, options: FSDPOptions) -> list[nn.Module]:
    """The modules sharded as units of their own, in order (the root is sharded after them): those
    train.options.units names, else the blocks the model names (`block_types`: a Hugging Face
    model's decoder layers), else the layers of its nn.Sequential."""
    blocks = step.blocks_of(model)
    if not options.units and blocks:
        return blocks
    names = options.units
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not found:
            kinds = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"train.options.units {names} names no module of this model; its modules are: {', '.join(kinds)}"
            )
        return found
    layers = meta.layers_of(model)
    held_by = Counter(id(p) for layer in layers for p in layer.parameters())  # each layer counts a parameter once
    shared = {k for k, n in held_by.items() if n > 1}
    return [
        layer
        for layer in layers
        if layer is not model
        and any(True for _ in layer.parameters())
        and not any(id(p) in shared for p in layer.parameters())
    ]


def shard(model: nn.Module, template: nn.Module, ctx: DistContext, options: FSDPOptions, seed: int) -> nn.Module:
    """`model` (on the meta device) sharded over every rank, each rank's shards initialised from
    the per-layer seeds as drawn for `template`, an unsharded meta copy of it (left on meta)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # The mesh's device type always given: with GPUs present, a gloo group would otherwise move the model to CUDA.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))

    def shard_one(module: nn.Module) -> None:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(DTYPES[options.param_dtype], DTYPES[options.reduce_dtype]),
            offload_policy=CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy(),
        )

    for unit in units_of(model, options):
        shard_one(unit)
    shard_one(model)
    model.to_empty(device="cpu" if options.cpu_offload else ctx.device)  # this rank's shards only
    for _, values in meta.initial_values(template, seed):
        load_shards(model, values)
    return model


def load_shards(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of each whole tensor in `values` into the sharded model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, value in values.items():
            target = _tensor(model, name)
            if isinstance(target, DTensor):
                # Every rank drew the same whole tensor: each takes its slice, nothing is sent.
                local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(value)


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def timed_collectives(model: nn.Module) -> InFlight:
    """Time FSDP2's all-gathers and reduce-scatters, run as torch runs them, on every sharded
    module of `model` (through `set_custom_all_gather` / `set_custom_reduce_scatter`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    clock = InFlight("parameter all-gathers and gradient reduce-scatters", fsdp_knobs)

    def timed(work, finished: Callable[[], None]):
        if work is None:  # synchronous: it is done
            finished()
        else:  # on the communication thread, when it has finished
            work.get_future().then(lambda _: finished())
        return work

    class TimedAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            finished = clock.launched()
            work = torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            return timed(work, finished)

    class TimedReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            finished = clock.launched()
            work = torch.distributed.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
            return timed(work, finished)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(TimedAllGather())
            module.set_custom_reduce_scatter(TimedReduceScatter())
    return clock


def fsdp_knobs(cfg: TrainConfig) -> str:
    """What to turn when sharded data parallelism spends its time communicating."""
    return (
        f"a larger batch per worker (train.batch_size, now {cfg.batch_size}), fewer workers "
        f"(FLYSCALE_NPROC_PER_NODE), train.options.reshard_after_forward: false (one all-gather a unit fewer, "
        f"more memory), or train.strategy: ddp if the model and its optimizer state fit one worker"
    )


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Micro-batches before the last of an accumulated step: gradients stay unsharded and local,
    reduce-scattered once, after the last micro-batch."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def lockstep_evaluator(model: nn.Module, data: TrainData, ctx: DistContext) -> Callable[[], tuple[float, float, float]]:
    """Validation over this rank's disjoint share, with every rank running the same forward calls:
    a sharded forward all-gathers, so a rank that stopped early would leave the others waiting.
    Each rank scores every world-th row of each batch (a share may be empty: it then runs one row
    and scores nothing)."""

    @torch.no_grad()
    def run() -> tuple[float, float, float]:
        was_training = model.training
        model.eval()
        loss_sum = correct = count = 0.0
        for xb, yb in data.val_batches():
            x, y = xb[ctx.rank :: ctx.world_size], yb[ctx.rank :: ctx.world_size]
            if len(y) == 0:
                scored(data.objective, model, xb[:1].to(ctx.device), yb[:1].to(ctx.device))
                continue
            loss, hits, n = scored(data.objective, model, x.to(ctx.device), y.to(ctx.device))
            loss_sum, correct, count = loss_sum + loss, correct + hits, count + n
        model.train(was_training)
        return loss_sum, correct, count

    return run


def gather(model: nn.Module, template: nn.Module, ctx: DistContext) -> nn.Module:
    """The whole trained model on rank 0 (built from `template`, a meta copy); the others get `template`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Every rank takes part in gathering; with cpu_offload only rank 0 keeps the result.
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return template
    meta.materialise(template, "cpu", seed=0)  # storage (a tie stays a tie); the values come next
    template.load_state_dict(whole)
    return template.to(ctx.device)


class FSDP:
    """Sharded data parallelism (FSDP2): parameters, gradients and optimizer state split over
    the ranks, each unit's parameters gathered only while it runs. Alone, it trains plainly."""

    options_type = FSDPOptions
    # batch_size rows per rank, as under ddp; each rank gives storage to its own shards only; its
    # checkpoints (DCP) resume on another number of workers.
    traits = StrategyTraits(per_worker_batch=True, meta_model=True, reshards=True)

    def parallelize(
        self, model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: FSDPOptions
    ) -> Parallelized:
        """`model` (on the meta device) sharded over every rank; rank 0 ends with the whole model."""
        # Still on the meta device: the layers' shapes, to draw initial values from, and at the end
        # the whole model rank 0 gathers into.
        template = copy.deepcopy(model) if ctx.distributed else model
        units = units_of(model, options)
        if cfg.activation_checkpointing:
            step.checkpoint_each(units)
        if not ctx.distributed:
            return Parallelized("fsdp", meta.materialise(model, ctx.device, cfg.seed))
        model = shard(model, template, ctx, options, cfg.seed)  # the optimizer's state is sharded too
        return Parallelized(
            "fsdp",
            model,
            no_sync=lambda: no_gradient_sync(model),
            evaluate=lockstep_evaluator(model, data, ctx),
            grad_comm_seconds=timed_collectives(model) if options.time_comm else None,
            whole=lambda: gather(model, template, ctx),
        )

    def check(self, model: nn.Module, cfg: TrainConfig, options: FSDPOptions, world_size: int) -> None:
        """Before any data work: the units exist, and offloading asks for a GPU."""
        units_of(model, options)
        if options.cpu_offload and not torch.cuda.is_available():
            raise ValueError("train.options.cpu_offload moves shards between host and GPU memory: it needs CUDA")


fsdp = FSDP()
