"""Cutting an nn.Sequential into pipeline stages: balanced cut points, the checks that a cut is
one the stages can train (trainable layers in each, no running statistics, no tie across
stages), and the stages as slices that keep the model's layer names."""

from __future__ import annotations

from typing import cast

from torch import nn

from flyscale.train import meta


def auto_split_points(model: nn.Sequential, n_stages: int) -> list[int]:
    """Cut points minimising the largest stage's parameter count, then its layer count."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = (float("inf"), float("inf"))
    # best[j][i]: the smallest possible (params, layers) of the heaviest stage when layers[:i]
    # form j stages. A bottleneck DP is exact here because max() is monotone in each argument.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0, 0)
    for j in range(1, n_stages + 1):
        for i in range(j, n + 1):
            for p in range(j - 1, i):
                cand = max(best[j - 1][p], (prefix[i] - prefix[p], i - p))
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, p
    points, i = [], n
    for j in range(n_stages, 1, -1):
        i = cut[j][i]
        points.append(i)
    return points[::-1]


def sequential(model: nn.Module) -> nn.Sequential:
    """`model`, which the pipeline strategy cuts between layers: it must be an nn.Sequential."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"the pipeline strategy cuts the model between its layers, so it needs an nn.Sequential, and this "
            f"one is a {type(model).__name__}: build it as an nn.Sequential of whole layers, or use train.strategy: ddp"
        )
    return model


def layers(model: nn.Module, start: int, stop: int) -> nn.Sequential:
    """Layers start:stop of `model`, with their names ("3.weight"): a Sequential's slice is one."""
    return cast(nn.Sequential, sequential(model)[start:stop])


def refuse_running_statistics(model: nn.Module) -> None:
    """Refuse layers whose running statistics the pipeline cannot keep right: a later stage sees
    its inputs only as micro-batches during the schedule (BatchNorm's mean and variance went to
    about -2e19 and inf, and every validation loss to NaN)."""
    norms = [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    if norms:
        raise ValueError(
            f"the pipeline strategy cannot keep BatchNorm's running statistics right, and the model has "
            f"{', '.join(norms)}: use LayerNorm or GroupNorm in the model, BatchNorm with "
            f"track_running_stats=False, or train.strategy: ddp"
        )


def split_bounds(model: nn.Module, n_stages: int, split_points: list[int]) -> list[int]:
    """[0, *cut points, len(model)]: stage k is layers bounds[k]:bounds[k+1] of `model`."""
    model = sequential(model)
    if len(model) < n_stages:
        raise ValueError(f"a model of {len(model)} layers cannot be split into {n_stages} pipeline stages")
    if not split_points:
        split_points = auto_split_points(model, n_stages)
    elif len(split_points) != n_stages - 1:
        raise ValueError(
            f"split_points must name exactly {n_stages - 1} point(s) for {n_stages} stages (the world size, times "
            f"stages_per_rank under interleaved_1f1b), "
            f"got {split_points}"
        )
    bounds = [0, *split_points, len(model)]
    if any(not 0 < p < len(model) for p in split_points) or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split_points must be strictly increasing in [1, {len(model) - 1}], got {split_points}")
    stage_of = lambda layer: next(k for k, b in enumerate(bounds[1:]) if layer < b)  # noqa: E731
    for (i, a_name), (j, b_name) in meta.shared_parameters(model):
        if stage_of(i) != stage_of(j):  # each stage would train its own copy: the weights would drift apart
            raise ValueError(
                f"layers {i} ({a_name}) and {j} ({b_name}) share one parameter (tied weights) but fall in stages "
                f"{stage_of(i)} and {stage_of(j)}: untie them (for flyscale's gpt: model.options.tie_embeddings: "
                f"false), or use train.strategy: ddp"
            )
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        # A stage without parameters does no learning and would hand AdamW an empty list.
        if not any(p.requires_grad for p in model[a:b].parameters()):
            raise ValueError(f"split_points {bounds[1:-1]} leave stage {k} ({model[a:b]}) without trainable parameters")
    return bounds


def split_model(model: nn.Module, n_stages: int, split_points: list[int]) -> list[nn.Sequential]:
    """The stages as slices of `model`: they share its parameters and keep its layer names."""
    bounds = split_bounds(model, n_stages, split_points)
    return [layers(model, a, b) for a, b in zip(bounds, bounds[1:])]
