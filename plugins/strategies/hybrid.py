"""Two-dimensional parallelism on a device mesh, as torchtitan composes it: data parallelism on
the `dp` dimension (FSDP2, or replication), and on the other either pipeline parallelism (`pp`:
each group of ranks holds a slice of the layers) or tensor parallelism (`tp`: each rank holds a
slice of every layer's matmuls).

    train: {strategy: hybrid, options: {mesh: {dp: 2, pp: 2}}}   # 4 workers
    train: {strategy: hybrid, options: {mesh: {dp: 2, tp: 2}}}   # 4 workers

`train.batch_size` is rows per data-parallel replica (all the ranks of one replica see the same
rows), so the global batch is batch_size x dp. The model arrives on the meta device; each rank
gives storage to its own part only and fills it from the same per-layer seeds as every other
strategy, so one process with the same seed starts from the same weights.

Tensor parallelism needs to know how to split a layer: a module says so in a `tp_plan`
attribute (flyscale's GPT blocks do), or `train.options.tp_plan` names module paths for a model
that does not.

Its options are in hybrid_options, and the mesh with the model laid out on it in hybrid_mesh.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.plugin.strategy_protocol import StrategyTraits
from flyscale.train import meta
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.objective import pairing, scored
from flyscale.train.step import StepFn, checkpoint_each
from flyscale.train.trainer import Parallelized
from flyscale_plugins.strategies import fsdp, pipeline
from flyscale_plugins.strategies.hybrid_mesh import (
    Layout,
    check_tensor_parallel,
    data_parallel,
    layout,
    plans,
    tensor_parallel,
)
from flyscale_plugins.strategies.hybrid_options import DATA_PARALLEL, MODEL_DIMENSIONS, STYLES, HybridOptions

# The pieces now in hybrid_options and hybrid_mesh stay importable from here.
__all__ = [
    "DATA_PARALLEL",
    "MODEL_DIMENSIONS",
    "STYLES",
    "Hybrid",
    "HybridOptions",
    "Layout",
    "check_tensor_parallel",
    "clip_grad_norm",
    "data_parallel",
    "hybrid",
    "layout",
    "lockstep_scores",
    "plans",
    "tensor_parallel",
]


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, ctx: DistContext, holders: int) -> None:
    """Clip by the norm of the whole model's gradient, whatever each rank holds of it.

    `holders`: how many ranks hold some of each parameter (all of them under tp, one stage's
    dp ranks under pp). A DTensor's local piece counts once among the ranks that hold the same
    piece; a plain tensor's among all its holders. One all-reduce of one float.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    local = 0.0
    for g in grads:
        if isinstance(g, DTensor):
            # Every placement but Replicate splits the tensor (Shard, and FSDP-over-TP's _StridedShard,
            # which is no Shard subclass); gradients are never left Partial.
            pieces = 1
            for dim, placement in enumerate(g.placements):
                if not placement.is_replicate():
                    pieces *= g.device_mesh.size(dim)
            local += float(g.to_local().detach().float().pow(2).sum()) * pieces / holders
        else:
            local += float(g.detach().float().pow(2).sum()) / holders
    total = ctx.all_reduce_sum([local])[0] ** 0.5
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)


def lockstep_scores(
    forward: Callable[[torch.Tensor, torch.Tensor], tuple[float, float, float] | None],
    data: TrainData,
    lay: Layout,
    counts: bool,
) -> Callable[[], tuple[float, float, float]]:
    """Validation over this replica's share (every dp-th row of each batch): every rank makes the
    same forward calls (a sharded forward gathers from its peers), an empty share runs one row and
    scores nothing, and only the ranks that `count` report sums."""

    @torch.no_grad()
    def run() -> tuple[float, float, float]:
        sums = [0.0, 0.0, 0.0]
        for xb, yb in data.val_batches():
            x, y = xb[lay.dp_rank :: lay.dp], yb[lay.dp_rank :: lay.dp]
            scored = forward(x, y) if len(y) else forward(xb[:1], yb[:1])
            if scored is not None and len(y) and counts:
                sums = [a + float(b) for a, b in zip(sums, scored)]
        return sums[0], sums[1], sums[2]

    return run


class Hybrid:
    """Data parallelism on `dp` with pipeline (`pp`) or tensor (`tp`) parallelism on the other
    mesh dimension. Alone, it trains plainly."""

    options_type = HybridOptions
    # batch_size rows per data-parallel replica (see `replicas`); each rank gives storage to its
    # own part only.
    traits = StrategyTraits(per_worker_batch=True, meta_model=True)

    def workers(self, options: HybridOptions) -> int | None:
        """The workers the mesh asks for (dp x the other degree); None when dp is left to the job."""
        return options.workers()

    def replicas(self, options: HybridOptions, world_size: int) -> int:
        """How many data-parallel replicas share the global batch: the mesh's dp."""
        return options.degrees(world_size)[0] if world_size > 1 else 1

    def parallelize(
        self, model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: HybridOptions
    ) -> Parallelized:
        """`model` (on the meta device) laid out on the mesh; rank 0 ends with the whole model."""
        if not ctx.distributed:
            return fsdp.fsdp.parallelize(model, data, cfg, ctx, fsdp.FSDPOptions())  # alone: plainly
        lay = layout(ctx, options)
        if options.model_dim == "tp":
            return _tensor_parallel(model, data, cfg, ctx, options, lay)
        return _pipeline_parallel(model, data, cfg, ctx, options, lay)

    def check(self, model: nn.Module, cfg: TrainConfig, options: HybridOptions, world_size: int) -> None:
        """Before any data work: the mesh fits the workers, and the model splits along it."""
        if world_size == 1:
            return
        dp, degree = options.degrees(world_size)
        if options.model_dim == "tp":
            check_tensor_parallel(model, options, degree)
        else:
            pipeline.check_stages(model, cfg, options.pipeline_options(), degree)


def _tensor_parallel(
    model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: HybridOptions, lay: Layout
) -> Parallelized:
    # On meta: the shapes to draw initial values from, and the model rank 0 gathers into.
    template = copy.deepcopy(model)
    units = fsdp.units_of(model, fsdp.FSDPOptions())
    if cfg.activation_checkpointing:
        checkpoint_each(units)
    tensor_parallel(model, lay.mesh["tp"], options)
    data_parallel([*units, model], lay.mesh["dp"], options)
    model.to_empty(device=ctx.device)  # this rank's pieces only
    for _, values in meta.initial_values(template, cfg.seed):
        fsdp.load_shards(model, values)
    counts = lay.model_rank == 0

    def forward(x: torch.Tensor, y: torch.Tensor):
        was = model.training
        model.eval()
        try:
            return scored(data.objective, model, x.to(ctx.device), y.to(ctx.device))
        finally:
            model.train(was)

    return Parallelized(
        "hybrid",
        model,
        no_sync=lambda: fsdp.no_gradient_sync(model),
        clip=lambda max_norm: clip_grad_norm(model.parameters(), max_norm, ctx, ctx.world_size),
        counts=counts,
        evaluate=lockstep_scores(forward, data, lay, counts),
        loader=data.train_loader(cfg, lay.data_ctx),
        grad_comm_seconds=fsdp.timed_collectives(model),  # dp's gathers and reductions (not tp's all-reduces)
        whole=lambda: fsdp.gather(model, template, ctx),
    )


def _pipeline_parallel(
    model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: HybridOptions, lay: Layout
) -> Parallelized:
    from torch.distributed.pipelining import PipelineStage

    pipeline.check_stages(model, cfg, options.pipeline_options(), lay.degree)
    template = copy.deepcopy(model)  # on meta: the whole model rank 0 assembles at the end
    bounds = pipeline.split_bounds(model, lay.degree, options.split_points)
    first, last = bounds[lay.model_rank], bounds[lay.model_rank + 1]
    meta.materialise(model, ctx.device, cfg.seed, range(first, last))  # this stage's layers only
    module = pipeline.layers(model, first, last).to(ctx.device)
    data_parallel([module], lay.mesh["dp"], options)  # the stage is one unit on its dp ranks
    pp_group = lay.mesh["pp"]
    stage = PipelineStage(module, lay.model_rank, lay.degree, ctx.device, group=pp_group.get_group())
    schedule = pipeline.SCHEDULES[options.schedule](
        stage, n_microbatches=options.microbatches, loss_fn=data.objective.loss
    )
    local = pipeline.LocalStage(module, schedule, lay.model_rank == 0, lay.model_rank == lay.degree - 1, data.objective)

    def step_with(optimizer: torch.optim.Optimizer, scheduler) -> StepFn:
        def step(xb: torch.Tensor, yb: torch.Tensor):
            optimizer.zero_grad(set_to_none=True)
            loss, correct = pipeline.forward_backward(local, xb, yb)  # dp gradients reduced after the last micro-batch
            if cfg.grad_clip_norm > 0:
                clip_grad_norm(module.parameters(), cfg.grad_clip_norm, ctx, lay.dp)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            return loss, correct, len(yb) if local.is_last else 0

        return step

    peers = pp_group.mesh.tolist()  # the global ranks of this replica's stages, in stage order
    pair = pairing(data.objective)

    def forward(x: torch.Tensor, y: torch.Tensor):
        if pair is not None:
            x, y = pair(x, y)
        module.eval()
        try:
            h = x.to(ctx.device) if local.is_first else ctx.recv_tensor(peers[lay.model_rank - 1])
            h = module(h)
            if not local.is_last:
                ctx.send_tensor(h, peers[lay.model_rank + 1])
                return None
            return data.objective.score(h, y.to(ctx.device))
        finally:
            module.train()

    return Parallelized(
        "hybrid",
        module,
        stage=True,
        step=step_with,
        evaluate=lockstep_scores(forward, data, lay, local.is_last),
        loader=data.train_loader(cfg, lay.data_ctx, drop_last=True),  # the schedule's buffers have a fixed shape
        grad_comm_seconds=fsdp.timed_collectives(module),  # dp's gathers and reductions (not the stages' sends)
        whole=lambda: _assemble(template, module, lay, ctx),
    )


def _assemble(template: nn.Module, module: nn.Module, lay: Layout, ctx: DistContext) -> nn.Module:
    """The whole trained model on rank 0, in `template` (a meta copy): each stage's dp ranks
    gather their stage (collectively, within their dp group), and its first dp rank sends it to
    rank 0. Other ranks get `template` back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Not cpu_offload: that keeps the result on global rank 0 only, which holds one stage.
    whole = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    own = {k: cast(torch.Tensor, v).detach().cpu() for k, v in whole.items()} if lay.dp_rank == 0 else {}
    parts = ctx.gather_object(own)
    if not ctx.is_main:
        return template
    merged: dict[str, torch.Tensor] = {}
    for part in parts:  # a stage keeps the model's layer names ("3.weight"): the parts fit together as they are
        merged.update(part)
    template.load_state_dict(merged, assign=True)
    return template.to(ctx.device)


hybrid = Hybrid()
