"""One optimizer step, as every data-parallel strategy takes it: the optimizer and its schedule,
mixed precision, gradient accumulation, activation checkpointing and clipping, all switched by
`TrainConfig`. Single-device code: DDP's `no_sync` arrives as a plain context-manager factory."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from flyscale.config import TrainConfig
from flyscale.train.objective import default as default_objective
from flyscale.train.objective import pairing

# A step trains on one batch and returns (mean loss, number correct or None when not tracked,
# rows) over the rows this rank accounts for: the batch under data parallelism, the whole global
# batch on a pipeline's last stage and 0 on its other stages (whose loss is then 0). Loss and
# hits stay 0-d tensors until the epoch ends: a float() per step would stall a GPU on every
# batch. The mean, not the sum: the epoch weights every step by its rows in one product at its
# end, instead of one more kernel on every step.
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None, int]]


class StandardStep:
    """A step function with the GradScaler it uses (fp16 only; else None): the scaler is part of
    the training state a checkpoint holds."""

    __slots__ = ("take", "scaler")

    def __init__(self, take: StepFn, scaler: torch.amp.GradScaler | None) -> None:
        self.take, self.scaler = take, scaler

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        return self.take(xb, yb)


def effective_lr(cfg: TrainConfig, world_size: int) -> float:
    """The linear scaling rule (Goyal et al. 2017): lr grows with the global batch."""
    if not cfg.scale_lr:
        return cfg.lr
    return cfg.lr * cfg.batch_size * world_size / cfg.base_batch_size


def make_optimizer(model: nn.Module, cfg: TrainConfig, world_size: int = 1) -> torch.optim.Optimizer:
    """AdamW, fused where torch has the kernel (floating-point parameters on CPU or CUDA).

    The fused kernel does the update's arithmetic in one pass over each parameter; the default
    (foreach) form makes several, and on a compute-bound 10M-parameter MLP on CPU it costs about a
    fifth of every step (benchmarks/bench_compute.py).
    """
    # Only what trains: a frozen weight (LoRA's base model) gets no gradient, and no optimizer state.
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(
        params, lr=effective_lr(cfg, world_size), weight_decay=cfg.weight_decay, fused=fused or None
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    """Linear warm-up over `warmup_epochs`, then constant."""
    warmup = max(1, round(cfg.warmup_epochs * steps_per_epoch)) if cfg.warmup_epochs > 0 else 0
    if not warmup:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))


def autocast(cfg: TrainConfig, device: torch.device) -> AbstractContextManager:
    """Mixed precision for the forward pass, as configured (`standard_step` vetted the device)."""
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks a model names by class in `block_types` (a transformers model's decoder
    layers), in order; none for a model that names none."""
    names = tuple(getattr(model, "block_types", ()))
    return [m for m in model.modules() if names and type(m).__name__ in names and m is not model]


def checkpointable(model: nn.Module) -> nn.Module:
    """The model, if activation checkpointing can split it: each of the blocks it names
    (`block_types`) is recomputed as a unit, else an nn.Sequential segment by segment."""
    if not blocks_of(model) and not isinstance(model, nn.Sequential):
        raise ValueError(
            f"train.activation_checkpointing needs a model built as nn.Sequential, or one that names its "
            f"repeated blocks (block_types), and this one is a {type(model).__name__} that names none: set it "
            f"to false, or build the model as a Sequential"
        )
    tracked = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    if tracked:  # the recompute in backward runs each BatchNorm again: its running statistics move twice a step
        raise ValueError(
            f"train.activation_checkpointing recomputes the forward in backward, which would update the running "
            f"statistics of BatchNorm layer {tracked[0]!r} twice a step: set it to false, or use a norm without "
            f"them (resnet's norm: group)"
        )
    return model


def checkpoint_each(units: list[nn.Module]) -> None:
    """Activation checkpointing per unit: its activations are recomputed in backward instead of
    kept. The forward is replaced on the instance, so state_dict keys stay as they are and a
    wrapper's hooks (DDP's, FSDP's) still run around it; keyword arguments (a transformers decoder
    layer's attention mask and positions) pass through."""
    for unit in units:
        plain = unit.forward

        def forward(self, *args, _plain=plain, **kwargs):
            if not self.training or not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        unit.forward = types.MethodType(forward, unit)


def enable_activation_checkpointing(model: nn.Module, segments: int = 2) -> nn.Module:
    """Recompute activations in backward: each block the model names (`block_types`), else an
    nn.Sequential segment by segment.

    Replacing the instance's forward (rather than wrapping the module) keeps state_dict keys
    unchanged and still routes DDP's forward through its wrapper.
    """
    model = checkpointable(model)
    blocks = blocks_of(model)
    if blocks or not isinstance(model, nn.Sequential):  # checkpointable: a model that is no Sequential names blocks
        checkpoint_each(blocks)
        return model
    sequential = model
    segments = min(segments, len(sequential))

    def forward(self, x):
        if not self.training or not torch.is_grad_enabled():
            return nn.Sequential.forward(self, x)
        return checkpoint_sequential(self, segments, x, use_reentrant=False)

    sequential.forward = types.MethodType(forward, sequential)  # type: ignore[method-assign]  # on purpose: see above
    return sequential


def standard_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    device: torch.device,
    scheduler=None,
    no_sync: Callable[[], AbstractContextManager] | None = None,
    objective: Any = None,
    clip: Callable[[float], None] | None = None,
) -> StandardStep:
    """Forward, the objective's loss (classification's cross-entropy when None), backward,
    update: the step every data-parallel strategy shares.

    With `grad_accum_steps = k` the batch is split into k micro-batches whose gradients add up
    to the whole batch's (each loss is weighted by its share); `no_sync` skips DDP's all-reduce
    for all but the last, so communication happens once per optimizer step. `clip(max_norm)`
    clips the gradients by their global norm where torch's `clip_grad_norm_` cannot see the
    whole model (parameters spread over several meshes); torch's is the default.
    """
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision 'fp16' needs CUDA; use 'bf16' on CPU")
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    k = cfg.grad_accum_steps
    track = cfg.track_train_accuracy
    mixed = cfg.precision != "fp32"
    objective = objective or default_objective()
    loss_fn, pair = objective.loss, pairing(objective)

    if k == 1 and not mixed and not track and cfg.grad_clip_norm == 0 and scheduler is None and pair is None:
        # The default, and the textbook step itself. Decided here, once, not on every step: on
        # the default MLP a step takes about 0.4 ms, and the general step's nested call and
        # branches measured 0-1.3% of it over paired epochs (benchmarks/bench_trainer.py's
        # method). tests/test_training_techniques.py holds the two to the same arithmetic.
        def plain_step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, None, int]:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            return loss.detach(), None, len(yb)

        return StandardStep(plain_step, None)

    def backward(xm: torch.Tensor, ym: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mixed:
            with autocast(cfg, device):
                outputs = model(xm)
                loss = loss_fn(outputs.float(), ym)
        else:
            outputs = model(xm)
            loss = loss_fn(outputs, ym)
        weighted = loss * weight if weight != 1.0 else loss
        (scaler.scale(weighted) if scaler else weighted).backward()
        return loss.detach(), objective.score(outputs.detach(), ym)[1] if track else None

    def step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        if pair is not None:  # a language model: the tokens before each position, and that position's
            xb, yb = pair(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        if k == 1:
            loss, correct = backward(xb, yb, 1.0)
        else:
            loss = torch.zeros((), device=xb.device)
            correct = torch.zeros((), device=xb.device, dtype=torch.long) if track else None
            chunks = list(zip(xb.chunk(k), yb.chunk(k)))
            for i, (xm, ym) in enumerate(chunks):
                last = i == len(chunks) - 1
                share = len(ym) / len(yb)
                with no_sync() if (no_sync and not last) else contextlib.nullcontext():
                    chunk_loss, chunk_correct = backward(xm, ym, share)
                loss += chunk_loss * share
                if correct is not None and chunk_correct is not None:
                    correct += chunk_correct
        if scaler:
            scaler.unscale_(optimizer)
        if cfg.grad_clip_norm > 0:
            if clip is not None:
                clip(cfg.grad_clip_norm)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return loss, correct, len(yb)

    return StandardStep(step, scaler)


def counted_once(step: StepFn, counts: bool) -> StepFn:
    """`step`, reporting its rows, loss and hits only where `counts`: the tensor-parallel ranks of
    a replica all compute the same loss on the same rows, and `fit` sums over ranks."""
    if counts:
        return step

    def quiet(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        loss, correct, _ = step(xb, yb)
        return loss * 0, None if correct is None else correct * 0, 0

    return quiet
