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

from collections.abc import Iterable

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
    """
    units = layers_of(model)
    for i in range(len(units)) if layers is None else layers:
        layer = units[i]
        if not is_meta(layer):
            continue
        _check_resettable(layer, i)
        layer.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((seed * _LAYER_STRIDE + i) % 2**63)
            for module in layer.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
        layer.to(device)
    return model


def check_materialisable(model: nn.Module) -> None:
    """ValueError naming the first layer `materialise` could not initialise (see _check_resettable),
    or two layers that share a parameter (tied weights), which materialising would untie."""
    shared = shared_parameters(model)
    if shared:
        (i, a), (j, b) = shared[0]
        raise ValueError(
            f"layers {i} ({a}) and {j} ({b}) share one parameter (tied weights, such as a language model's "
            f"input and output embeddings): materialising them one layer at a time would untie them. Untie them "
            f"(for flyscale's gpt: model.options.tie_embeddings: false), or use a strategy that builds the model "
            f"in memory (e.g. 'ddp')"
        )
    for i, layer in enumerate(layers_of(model)):
        _check_resettable(layer, i)


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


def _check_resettable(layer: nn.Module, index: int) -> None:
    """Every module holding tensors of its own must know how to initialise them (reset_parameters)."""
    for name, module in layer.named_modules():
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if owns and not callable(getattr(module, "reset_parameters", None)):
            where = f"layer {index}" + (f" ({name})" if name else "")
            raise ValueError(
                f"cannot initialise {where}, a {type(module).__name__}, from the meta device: it holds parameters or "
                "buffers but has no reset_parameters() method. Give it one (torch's own layers all have it), "
                "or use a strategy that builds the model in memory (e.g. 'ddp')"
            )
