"""The device mesh and the model laid out on it: this rank's place on the mesh, FSDP2 (or
replication) along dp, and tensor-parallel plans along tp, with the checks that they split."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from flyscale.train.distributed import DistContext
from flyscale_plugins.strategies.hybrid_options import HybridOptions


@dataclass
class Layout:
    """This rank's place on the mesh, and the context its data is drawn by (its dp replica's)."""

    mesh: Any  # torch DeviceMesh with dimensions "dp" and "pp" or "tp"
    dp: int
    dp_rank: int
    degree: int  # of the model dimension
    model_rank: int
    data_ctx: DistContext  # rank = dp_rank, world_size = dp: the rows this replica trains and scores


def layout(ctx: DistContext, options: HybridOptions) -> Layout:
    from torch.distributed.device_mesh import init_device_mesh

    dp, degree = options.degrees(ctx.world_size)
    kind = options.model_dim
    # Tensor parallelism talks on every layer, so its ranks are neighbours (innermost: one node);
    # pipeline stages talk least, so they are outermost (torchtitan lays meshes out the same way).
    shape, names = ((dp, degree), ("dp", kind)) if kind == "tp" else ((degree, dp), (kind, "dp"))
    # The device type always given: with GPUs present, a gloo group would otherwise move the model to CUDA.
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    dp_rank, model_rank = mesh.get_local_rank("dp"), mesh.get_local_rank(kind)
    data_ctx = dataclasses.replace(ctx, rank=dp_rank, world_size=dp)
    return Layout(mesh, dp, dp_rank, degree, model_rank, data_ctx)


def data_parallel(modules: Iterable[nn.Module], mesh, options: HybridOptions) -> None:
    """FSDP2 (or its replication) over the dp dimension, unit by unit, the last module being the root."""
    from torch.distributed._composable.replicate_with_fsdp import replicate  # private, as in torchtitan
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        if options.data_parallel == "fsdp":
            fully_shard(module, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
        else:
            replicate(module, mesh=mesh)


def tensor_parallel(model: nn.Module, mesh, options: HybridOptions) -> None:
    """Split the matmuls each module's `tp_plan` (or the config's) names over the tp dimension."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for module, plan in plans(model, options):
        parallelize_module(module, mesh, {path: style[s]() for path, s in plan.items()})


def plans(model: nn.Module, options: HybridOptions) -> list[tuple[nn.Module, dict[str, str]]]:
    """(module, its plan) for every module that declares a `tp_plan`, or the config's at the root."""
    if options.tp_plan:
        return [(model, options.tp_plan)]
    return [(m, cast(dict, m.tp_plan)) for m in model.modules() if isinstance(getattr(m, "tp_plan", None), dict)]


def check_tensor_parallel(model: nn.Module, options: HybridOptions, tp: int) -> None:
    """Every planned layer splits into `tp` whole pieces, and every split by heads gives each rank whole heads."""
    found = plans(model, options)
    if not found:
        raise ValueError(
            f"train.options.mesh asks for tensor parallelism, and no module of this {type(model).__name__} declares "
            f"a tp_plan: give train.options.tp_plan (module path: colwise | rowwise), or use mesh {{dp: N, pp: M}}"
        )
    for name, m in model.named_modules():
        heads = getattr(m, "heads", None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"{name or 'the model'} has {heads} attention heads, which tp={tp} ranks cannot share out")
    for module, plan in found:
        for path, style in plan.items():
            if "*" in path:
                continue
            try:
                linear = module.get_submodule(path)
            except AttributeError:
                raise ValueError(f"tp_plan names {path!r}, and {type(module).__name__} has no such module") from None
            if not isinstance(linear, nn.Linear) or style not in ("colwise", "rowwise"):
                # A Hugging Face model declares a plan of its own kind (embeddings, wildcards, more styles).
                raise ValueError(
                    f"the tp_plan of {type(module).__name__} names {path!r}, a {type(linear).__name__}, {style}: "
                    f"flyscale's tensor parallelism splits only nn.Linear layers, colwise or rowwise. Give "
                    f"train.options.tp_plan naming the Linear layers to split, or use train.strategy: fsdp"
                )
            size = linear.out_features if style == "colwise" else linear.in_features
            if size % tp:
                raise ValueError(f"{path} ({linear}) cannot be split {style} into {tp} equal parts: {size} features")
