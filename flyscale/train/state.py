"""The training state a checkpoint holds: what a strategy hands `fit` (this rank's model part,
optimizer, scheduler, scaler), where training stands in the data, and every RNG's state."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass
class TrainState:
    """What a strategy hands `fit` so that training can be checkpointed and resumed.

    `module` is what this rank holds of the model: the whole model (ddp), its shards of every
    tensor (fsdp: DTensors), or its stage's layers (pipeline: `stage`, whose optimizer then holds
    only that stage's state).
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    stage: bool = False  # `module` is some of the model's layers, not all
    # Early stopping: a copy of `module`'s state at the best epoch so far (this rank's part of it,
    # sharded as the module is), checkpointed with it. None until an epoch has been kept.
    best: dict[str, torch.Tensor] | None = None

    def keep_best(self) -> None:
        """Copy what this rank holds of the model as the best epoch's weights."""
        self.best = {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_start(self, path: str) -> None:
        """Load the whole model's weights from a state_dict file into what this rank holds of it: all
        of them, its shards of each (fsdp, tp), or its stage's layers (pipeline).

        The file is memory-mapped, not read: its pages are the operating system's (shared by the
        workers of a node, and dropped under pressure), so no worker holds a private copy of the
        whole model on its way to its part of it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        whole = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        mine = self.module.state_dict()
        missing = [k for k in mine if k not in whole]
        if missing or (not self.stage and len(whole) != len(mine)):
            raise ValueError(f"the starting weights {path} do not fit this model (missing: {missing[:5]})")
        set_model_state_dict(
            self.module, {k: whole[k] for k in mine}, options=StateDictOptions(full_state_dict=True, strict=True)
        )

    @torch.no_grad()
    def restore_best(self) -> None:
        """Put the kept weights back into the module, in place (a sharded module stays sharded)."""
        if self.best is None:
            raise RuntimeError("restore_best called before any epoch was kept")
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            tensor.copy_(self.best[name])

    def signature(self) -> list[list]:
        """[name, shape, dtype] of every tensor in the module's state a checkpoint holds (all but
        frozen parameters, see `_trained_only`): what 'the same model' means."""
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return [[k, list(v.shape), str(v.dtype)] for k, v in self.module.state_dict().items() if k not in frozen]

    def sharded_state(self) -> dict[str, Any]:
        """The model's and the optimizer's tensors as torch.distributed.checkpoint saves and loads
        them, keyed by parameter name: what this rank holds (plain tensors, or DTensors of its
        shards). The optimizer's hyperparameters travel in `schedule_state`: DCP writes a value
        that is not a tensor from one rank only, and a pipeline stage's groups are its own."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer, options=_trained_only())
        state: dict[str, Any] = {"model": model, "optimizer": {"state": optimizer["state"]}}
        if self.best is not None:
            state["best"] = self.best  # DCP loads it in place, resharded like the model
        return state

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # its groups, by name, as set_state_dict wants
        _, current = get_state_dict(self.module, self.optimizer, options=_trained_only())
        optimizer = {"state": state["optimizer"]["state"], "param_groups": current["param_groups"]}
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=optimizer,
            options=_trained_only(),
        )

    def schedule_state(self) -> dict[str, Any]:
        """The optimizer's hyperparameters (the scheduled lr among them), the LR scheduler's and
        the grad scaler's state: the same on every rank."""
        return {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_schedule_state(self, state: dict[str, Any]) -> None:
        for group, saved in zip(self.optimizer.param_groups, state.get("param_groups") or []):
            group.update(saved)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, `batch` batches into epoch `epoch`."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    # This rank's sums over the batches of `epoch` done so far, so a resumed epoch reports what
    # an uninterrupted one would: per-step losses, hits, rows, data-wait and busy seconds.
    losses: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    rows: int = 0
    wait: float = 0.0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # the finished epochs' metrics (rank 0's)


@dataclass
class Resumed:
    """What a resume restored, for the history and the tests: from which step, from where."""

    step: int
    source: str  # "local" (the restart directory) or "mirror" (the previous Flyte attempt)
    path: str
    world_size: int = 0  # of the run that wrote it


def rng_state() -> dict[str, Any]:
    """Every RNG training may draw from, in a form `weights_only` loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(value):
    # random.setstate wants the tuples it gave; a round trip may hand back lists.
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _trained_only():
    """A checkpoint holds what trains: a frozen weight (LoRA's base model) never changes, and comes
    back from the starting weights (`load_start`) on every attempt. Loading is not strict about
    the frozen ones it lacks; what it holds was checked against the model before any load
    (checkpoint_choice.same_model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)
