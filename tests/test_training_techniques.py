"""Each technique switch changes speed or memory, not the math (or, for bf16, barely)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from flyscale.config import TrainConfig
from flyscale.train import trainer
from flyscale.train.batches import TensorBatches, TrainData, make_loader
from flyscale.train.distributed import DistContext, set_epoch
from flyscale.train.step import (
    effective_lr,
    enable_activation_checkpointing,
    make_optimizer,
    make_scheduler,
    standard_step,
)
from flyscale.train.trainer import fit
from flyscale_plugins.datasets import digits
from flyscale_plugins.models import CNN, MLP, CNNOptions, MLPOptions
from flyscale_plugins.strategies.ddp import DDPOptions, ddp

CPU = torch.device("cpu")


def _mlp():
    torch.manual_seed(0)
    return MLP().build(MLPOptions(hidden=[64, 32], dropout=0.0), digits.info(None))


def _batch(n=32):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 64, generator=g) * 16, torch.randint(0, 10, (n,), generator=g)


def _steps(cfg: TrainConfig, model, steps=3):
    opt = make_optimizer(model, cfg)
    step = standard_step(model, opt, cfg, CPU)
    x, y = _batch()
    for _ in range(steps):
        step(x, y)
    return model.state_dict()


@pytest.mark.parametrize(
    "rows,world,drop_last",
    [
        (37, 1, False),
        (37, 1, True),  # one process: RandomSampler
        (37, 2, False),
        (37, 3, True),  # ranks: DistributedSampler, padded or cut
        (3, 8, False),  # fewer rows than ranks: the padding repeats the order more than once
        (203, 1, False),
        (203, 2, True),  # more batches than one gather holds (GATHER_BYTES, set small below)
    ],
)
def test_sliced_batches_are_the_dataloaders_batches_in_its_order_on_every_rank_and_epoch(
    rows, world, drop_last, monkeypatch
):
    # The in-memory path slices its batches with the order drawn by distributed.sampler_order
    # instead of iterating the sampler; the batches (and so the trained weights) must stay the
    # DataLoader's, including a DistributedSampler's padding, and the draws after an epoch too.
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    y = torch.arange(rows)
    monkeypatch.setattr(TensorBatches, "GATHER_BYTES", 40 * (x[:1].nbytes + y[:1].nbytes))  # 10 batches of 4 a gather
    for rank in range(world):
        ctx = DistContext(rank=rank, world_size=world)
        ours = TensorBatches(x, y, ctx.train_sampler(TensorDataset(x, y), seed=5), 4, drop_last)
        theirs = DataLoader(
            TensorDataset(x, y),
            batch_size=4,
            drop_last=drop_last,
            sampler=ctx.train_sampler(TensorDataset(x, y), seed=5),
        )
        assert len(ours) == len(theirs)
        for epoch in (0, 1):
            set_epoch(ours, epoch)
            set_epoch(theirs, epoch)
            for _ in range(2):  # a second pass without set_epoch draws on as the sampler does
                got, want = list(ours), list(theirs)
                assert [b[1].tolist() for b in got] == [b[1].tolist() for b in want], (rank, epoch)
                assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want))


def test_grad_accumulation_of_k_microbatches_equals_one_full_batch():
    ref = _steps(TrainConfig(batch_size=32), _mlp())
    acc = _steps(TrainConfig(batch_size=32, grad_accum_steps=4), _mlp())
    for name in ref:
        torch.testing.assert_close(acc[name], ref[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 4])
def test_a_step_reports_its_batchs_mean_loss(k):
    # A last batch of 30 rows in 4 micro-batches is 8, 8, 8 and 6: unequal shares, weighted by rows.
    model, (x, y) = _mlp(), _batch(30)
    expected = F.cross_entropy(model(x), y).detach()  # before the step updates the weights
    cfg = TrainConfig(batch_size=32, grad_accum_steps=k, track_train_accuracy=True)
    loss, correct, rows = standard_step(model, make_optimizer(model, cfg), cfg, CPU)(x, y)
    torch.testing.assert_close(loss, expected)
    assert rows == 30 and 0 <= int(correct) <= 30


def _linear_dtypes(model) -> list[torch.dtype]:
    """Record the dtype every Linear layer computes in, while the hooks are attached."""
    seen: list[torch.dtype] = []
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def test_bf16_step_computes_in_bf16_and_lands_close_to_fp32():
    """flyscale's own step with precision bf16: its layers really run in bf16, and the gradients
    it steps on are within bf16's rounding of the fp32 step's."""
    x, y = _batch(64)
    grads, losses = {}, {}
    for precision in ("fp32", "bf16"):
        model = _mlp()
        seen = _linear_dtypes(model)
        cfg = TrainConfig(precision=precision)
        loss, _, _ = standard_step(model, make_optimizer(model, cfg), cfg, CPU)(x, y)
        assert set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}, precision
        losses[precision] = float(loss)
        grads[precision] = torch.cat([p.grad.flatten() for p in model.parameters()])  # kept until the next step
    assert abs(losses["bf16"] - losses["fp32"]) / losses["fp32"] < 1e-2
    assert not torch.equal(grads["bf16"], grads["fp32"])  # a different computation ...
    assert F.cosine_similarity(grads["bf16"], grads["fp32"], dim=0) > 0.999  # ... to the same end


def test_fp16_refuses_cpu_with_a_clear_error():
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        _steps(TrainConfig(precision="fp16"), _mlp(), steps=1)


def test_activation_checkpointing_recomputes_and_gives_identical_gradients():
    x = torch.rand(8, 64) * 16
    y = torch.randint(0, 10, (8,))
    grads, forwards = [], []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = CNN().build(CNNOptions(channels=[4, 8], hidden=16, dropout=0.0), digits.info(None))
        if checkpointed:
            enable_activation_checkpointing(model)
        calls = []
        for layer in model:
            layer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        F.cross_entropy(model.train()(x), y).backward()
        forwards.append(len(calls))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        keys = set(model.state_dict())
    # Checkpointing recomputes the forward of the segments whose activations it did not keep.
    assert forwards[0] == len(model) and forwards[1] > forwards[0], forwards
    assert keys == set(grads[0])  # state_dict keys unchanged by checkpointing
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name])


def test_linear_lr_scaling_and_warmup():
    cfg = TrainConfig(lr=0.001, batch_size=32, base_batch_size=32, scale_lr=True, warmup_epochs=1.0)
    assert effective_lr(cfg, world_size=4) == pytest.approx(0.004)
    assert effective_lr(TrainConfig(lr=0.001), world_size=4) == pytest.approx(0.001)
    model = _mlp()
    opt = make_optimizer(model, cfg, world_size=2)
    sched = make_scheduler(opt, cfg, steps_per_epoch=10)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.002 / 10)
    assert lrs[9] == pytest.approx(0.002) and lrs[11] == pytest.approx(0.002)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))


@pytest.mark.parametrize(
    "general",
    [TrainConfig(track_train_accuracy=True), TrainConfig(grad_clip_norm=1e9)],
    ids=["tracking accuracy", "clipping at a norm never reached"],
)
def test_the_default_step_does_the_general_steps_arithmetic(general):
    # standard_step builds a lean step for the default config (fp32, no accumulation, clipping,
    # schedule or accuracy); switching on something that changes no number takes the general
    # step, which must give the very same losses and weights, bit for bit.
    x, y = _batch()
    runs = []
    for cfg in (TrainConfig(), general):
        model = _mlp()
        step = standard_step(model, make_optimizer(model, cfg), cfg, CPU)
        runs.append(([step(x, y)[0].item() for _ in range(3)], model.state_dict()))
    (lean_losses, lean), (general_losses, general_state) = runs
    assert lean_losses == general_losses
    assert all(torch.equal(lean[k], general_state[k]) for k in lean)


def test_grad_clipping_bounds_the_update():
    model = _mlp()
    cfg = TrainConfig(grad_clip_norm=0.01, lr=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    standard_step(model, opt, cfg, CPU)(*_batch())
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (after - before).norm() <= 0.01 + 1e-6  # SGD lr 1: the update is the clipped gradient


class SlowDigits(Dataset):
    """A dataset whose reads cost time, like decoding images from disk."""

    def __init__(self, x, y, delay):
        self.x, self.y, self.delay = x, y, delay

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def test_input_bound_run_is_diagnosed_with_the_knob_to_turn():
    x, y = _batch(64)
    cfg = TrainConfig(epochs=1, batch_size=16)
    model = _mlp()
    opt = make_optimizer(model, cfg)
    # 0.5 s of reads a batch: far more than a loaded machine's first steps of this MLP take.
    loader = make_loader(SlowDigits(x, y, 0.03), None, cfg, DistContext())
    history = fit(
        model, standard_step(model, opt, cfg, CPU), loader, lambda: (0.0, 0.0, 1.0), cfg, DistContext(), "ddp"
    )
    m = history.epochs[0]
    assert m.data_wait_fraction > 0.5
    assert "train.num_workers" in history.diagnosis
    assert history.steps == history.steps_run == len(loader) == 4  # counted without a per-step hook


class Hungry(torch.nn.Module):
    """An MLP whose training forward also touches 300 MB (written, so resident)."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        if self.training:
            ballast = torch.ones(300 * 2**20 // 4)
            x = x + ballast[:1] * 0
        return self.inner(x)


def _peak_before_and_after_training() -> tuple[float, float]:
    from flyscale.train.telemetry import peak_memory_mb

    x, y = _batch(64)
    cfg = TrainConfig(epochs=1, batch_size=32)
    before = peak_memory_mb(CPU)
    model = Hungry()
    loader = make_loader(torch.utils.data.TensorDataset(x, y), None, cfg, DistContext())
    step = standard_step(model, make_optimizer(model, cfg), cfg, CPU)
    return before, fit(model, step, loader, lambda: (0.0, 0.0, 1.0), cfg, DistContext(), "ddp").epochs[0].peak_memory_mb


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_peak_memory_tracks_what_training_allocates():
    """The metric is the process's peak resident memory: a step that touches 300 MB raises it by as much.
    (In a fresh process: the suite's own history would hide the rise in a peak.)"""
    from tests.distributed_helpers import run_on_ranks

    ((before, peak),) = run_on_ranks(_peak_before_and_after_training, 1)
    assert peak >= before + 250, (before, peak)


def test_a_diverging_loss_stops_training_naming_the_epoch_step_and_knobs():
    x, y = _batch(64)
    x[40] = float("nan")  # one poisoned row: its batch's loss is NaN
    cfg = TrainConfig(epochs=3, batch_size=16, lr=0.5)
    model = _mlp()
    loader = make_loader(
        torch.utils.data.TensorDataset(x, y), None, cfg, DistContext()
    )  # in order: row 40 is in step 3
    from flyscale.train.loop import TrainingDiverged

    with pytest.raises(
        TrainingDiverged,
        match=r"diverged in epoch 1, at step 3 of 4 on rank 0.*lower train.lr \(now 0.5\)"
        r".*train.grad_clip_norm",
    ):
        fit(
            model,
            standard_step(model, make_optimizer(model, cfg), cfg, CPU),
            loader,
            lambda: (0.0, 0.0, 1.0),
            cfg,
            DistContext(),
            "ddp",
        )


def test_ddp_strategy_reports_throughput_and_fractions():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(256, 64, generator=g) * 16, torch.randint(0, 10, (256,), generator=g)
    cfg = TrainConfig(epochs=2, batch_size=32, grad_accum_steps=2, warmup_epochs=0.5)
    result = trainer.train(ddp, _mlp(), TrainData(x, y, x[:32], y[:32]), cfg, DistContext(), DDPOptions())
    assert all(m.train_accuracy is None for m in result.history.epochs)  # not measured by default
    tracked = trainer.train(
        ddp,
        _mlp(),
        TrainData(x, y, x[:32], y[:32]),
        TrainConfig(epochs=1, batch_size=32, track_train_accuracy=True),
        DistContext(),
        DDPOptions(),
    )
    assert 0.0 <= tracked.history.epochs[0].train_accuracy <= 1.0
    for m in result.history.epochs:
        assert m.samples_per_s > 0
        assert 0.0 <= m.data_wait_fraction < 1.0 and 0.0 < m.compute_fraction <= 1.0
        assert m.lr == pytest.approx(cfg.lr)


def test_a_validation_loss_that_is_not_finite_stops_training_naming_the_epoch_and_cause():
    x, y = _batch(64)
    cfg = TrainConfig(epochs=3, batch_size=16)
    model = _mlp()
    loader = make_loader(torch.utils.data.TensorDataset(x, y), None, cfg, DistContext())
    from flyscale.train.loop import TrainingDiverged

    with pytest.raises(TrainingDiverged, match=r"validation loss is not finite \(nan\) after epoch 1.*BatchNorm"):
        fit(
            model,
            standard_step(model, make_optimizer(model, cfg), cfg, CPU),
            loader,
            lambda: (float("nan"), 0.0, 8.0),  # what a model with broken running statistics gives
            cfg,
            DistContext(),
            "ddp",
        )
