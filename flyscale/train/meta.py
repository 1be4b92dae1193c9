"""Models built on the meta device, and materialised one layer at a time.

A strategy that splits the model (the pipeline strategy) never needs all of it on one rank:
it builds the model on the meta device (shapes, no storage) and materialises only its own
layers, as torchtitan does. For the ranks to agree on the initial weights wherever each layer
lives, a layer's initial weights depend only on the seed and the layer's index, never on which
layers were materialised before it: every layer draws from its own seeded generator.
One process materialising every layer therefore starts from exactly the weights the stages
start from together, which is what the equivalence checks compare.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# Odd and large, so that nearby seeds and layer indices never give the same generator seed.
_LAYER_STRIDE = 1_000_003


def is_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of `module` has no storage yet."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The units materialised one at a time: a Sequential's layers, else the whole model."""
    return list(model) if isinstance(model, nn.Sequential) else [model]


def materialise(
    model: nn.Module, device: torch.device | str, seed: int, layers: Iterable[int] | None = None
) -> nn.Module:
    """Give storage and initial weights to the layers `layers` (default: all) of a meta `model`.

    Layers already materialised are left as they are. Weights are drawn on the CPU (the same
    numbers on every device type) and then moved to `device`; the global RNG is left untouched.
    A parameter two layers share (tied weights) stays one parameter, initialised by the first
    layer that holds it.
    """
    units = layers_of(model)
    owner = owners(model)
    for i in range(len(units)) if layers is None else layers:
        layer = units[i]
        if not is_meta(layer):
            continue
        _init_layer(layer, i, seed, {k for k, first in owner.items() if first < i})
        layer.to(device)
    return model


def owners(model: nn.Module) -> dict[int, int]:
    """{id(parameter or buffer): the index of the first layer holding it}."""
    first: dict[int, int] = {}
    for i, layer in enumerate(layers_of(model)):
        for _, t in _named_tensors(layer):
            first.setdefault(id(t), i)
    return first


def _init_layer(layer: nn.Module, index: int, seed: int, earlier: set[int]) -> None:
    """Storage on the CPU for the meta tensors of `layer`, and the initial values its modules
    draw from the layer's own generator. Modules whose tensors all belong to earlier layers
    (`earlier`: their ids) are left alone: a tied weight is initialised once, by its first layer."""
    _check_resettable(layer, index, earlier)
    for module in layer.modules():
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is not None and t.is_meta:
                    # Swapped in place, not replaced: a parameter held by two modules stays one.
                    fresh = torch.empty_like(t, device="cpu")
                    torch.utils.swap_tensors(
                        t, nn.Parameter(fresh, t.requires_grad) if isinstance(t, nn.Parameter) else fresh
                    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * _LAYER_STRIDE + index) % 2**63)
        for module in layer.modules():
            if _own_tensors(module) and all(id(t) in earlier for t in _own_tensors(module)):
                continue
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def initial_values(template: nn.Module, seed: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(layer index, {name in the model: initial value}) for every layer of a meta `template`, one
    layer at a time, as `materialise` gives them: what a strategy that shards every tensor copies
    its shards from, so that no rank ever holds more than one whole layer. A tensor two layers
    share comes once, with its first layer. The template is left on the meta device."""
    owner = owners(template)
    for i, layer in enumerate(layers_of(template)):
        names = {id(t): n for n, t in _named_tensors(layer)}
        fresh = copy.deepcopy(layer)
        mine = {n for k, n in names.items() if owner[k] == i}
        copies = dict(_named_tensors(fresh))
        skip = {id(copies[n]) for k, n in names.items() if owner[k] != i}
        _init_layer(fresh, i, seed, skip)
        prefix = f"{i}." if isinstance(template, nn.Sequential) else ""
        yield i, {prefix + n: copies[n].detach() for n in sorted(mine)}


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (a shared one once per holder)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def check_materialisable(model: nn.Module) -> None:
    """ValueError naming the first layer `materialise` could not initialise (see _check_resettable)."""
    owner = owners(model)
    for i, layer in enumerate(layers_of(model)):
        _check_resettable(layer, i, {k for k, first in owner.items() if first < i})


def check_untied(model: nn.Module, why: str) -> None:
    """ValueError naming two layers that share a parameter (tied weights), where `why` they cannot."""
    shared = shared_parameters(model)
    if shared:
        (i, a), (j, b) = shared[0]
        raise ValueError(
            f"layers {i} ({a}) and {j} ({b}) share one parameter (tied weights, such as a language model's "
            f"input and output embeddings), and {why}. Untie them (for flyscale's gpt: "
            f"model.options.tie_embeddings: false), or use a strategy that keeps them together (e.g. 'ddp' or 'fsdp')"
        )


def shared_parameters(model: nn.Module) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Parameters held by two different layers: ((layer, name), (layer, name)) for each."""
    first: dict[int, tuple[int, str]] = {}
    out = []
    for i, layer in enumerate(layers_of(model)):
        for name, p in layer.named_parameters(remove_duplicate=False):
            seen = first.setdefault(id(p), (i, name))
            if seen[0] != i:
                out.append((seen, (i, name)))
    return out


def _check_resettable(layer: nn.Module, index: int, earlier: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Every module holding tensors of its own must know how to initialise them (reset_parameters),
    unless they all belong to an earlier layer (`earlier`: their ids), which initialises them."""
    for name, module in layer.named_modules():
        own = _own_tensors(module)
        if not own or all(id(t) in earlier for t in own):
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            where = f"layer {index}" + (f" ({name})" if name else "")
            raise ValueError(
                f"cannot initialise {where}, a {type(module).__name__}, from the meta device: it holds parameters or "
                "buffers but has no reset_parameters() method. Give it one (torch's own layers all have it), "
                "or use a strategy that builds the model in memory (e.g. 'ddp')"
            )
