"""DDP is data parallelism and nothing else: world size 2 with batch B == one process with 2B."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flyscale.config import TrainConfig
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import process_group
from flyscale.train.telemetry import EpochMetrics, diagnose
from flyscale_plugins.datasets import digits
from flyscale_plugins.models import MLP, MLPOptions
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from tests.distributed_helpers import run_on_ranks

B = 8  # per-rank batch
STEPS = 5


def _data() -> TrainData:
    g = torch.Generator().manual_seed(0)
    n = 2 * B * STEPS
    x = torch.rand(n, 64, generator=g) * 16
    y = torch.randint(0, 10, (n,), generator=g)
    return TrainData(x, y, x[:16], y[:16])


def _model():
    torch.manual_seed(0)
    return MLP().build(MLPOptions(hidden=[32, 16], dropout=0.0), digits.info(None))


def _cfg(batch: int, accum: int = 1) -> TrainConfig:
    return TrainConfig(epochs=1, batch_size=batch, lr=1e-2, seed=3, grad_accum_steps=accum)


def _train_ddp(bucket_cap_mb: float, accum: int):
    with process_group(timeout_s=60) as ctx:
        result = trainer.train(ddp, _model(), _data(), _cfg(B, accum), ctx, DDPOptions(bucket_cap_mb=bucket_cap_mb))
        return {k: v.clone() for k, v in result.model.state_dict().items()}, result.history.epochs


def _reference() -> dict[str, torch.Tensor]:
    """A plain loop over the same global batches: DistributedSampler's permutation, 2B at a time."""
    data, model, cfg = _data(), _model(), _cfg(2 * B)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    perm = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(cfg.seed + 0))
    for step in range(STEPS):
        idx = perm[step * 2 * B : (step + 1) * 2 * B]
        opt.zero_grad()
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(180)
# Many tiny buckets, one bucket, and gradient accumulation (2 micro-batches under no_sync).
@pytest.mark.parametrize("bucket_cap_mb, accum", [(0.001, 1), (25.0, 1), (25.0, 2)])
@pytest.mark.slow
def test_ddp_world2_matches_single_process_with_double_batch(bucket_cap_mb, accum):
    (state0, epochs0), (state1, _) = run_on_ranks(_train_ddp, 2, bucket_cap_mb, accum)
    reference = _reference()
    assert len(epochs0) == 1
    # The timed comm hook saw the gradient all-reduces (and they fit inside the epoch).
    assert 0.0 < epochs0[0].grad_comm_fraction < 1.0
    for name, ref in reference.items():
        torch.testing.assert_close(state0[name], ref, rtol=1e-5, atol=1e-6, msg=f"{name} differs from reference")
        torch.testing.assert_close(state1[name], state0[name], rtol=0, atol=0, msg=f"{name} differs across ranks")
    # And the run did move the weights: the comparison is not between two untouched models.
    assert not torch.allclose(reference["0.weight"], _model().state_dict()["0.weight"])


def _uneven(world_rows: int):
    """An odd number of rows: DistributedSampler pads, so both ranks run the same number of steps."""
    with process_group(timeout_s=30) as ctx:
        g = torch.Generator().manual_seed(0)
        x, y = torch.rand(world_rows, 64, generator=g), torch.randint(0, 10, (world_rows,), generator=g)
        result = trainer.train(ddp, _model(), TrainData(x, y, x[:5], y[:5]), _cfg(B), ctx, DDPOptions(time_comm=False))
        return [m.grad_comm_fraction for m in result.history.epochs]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_uneven_shards_do_not_hang():
    # 2 * B * STEPS + 1 rows: one rank would have a batch more than the other without padding.
    # One epoch each; with time_comm off no all-reduce is timed.
    assert run_on_ranks(_uneven, 2, 2 * B * STEPS + 1, timeout=60) == [[0.0], [0.0]]


def _diagnosis_on_the_digits_mlp() -> tuple[str, float]:
    """Two workers on a digits-sized MLP at batch 32: communication-bound (bench_data_parallel
    measures them at about a quarter of one process's throughput here)."""
    with process_group(timeout_s=60) as ctx:
        g = torch.Generator().manual_seed(0)
        x, y = torch.rand(2560, 64, generator=g) * 16, torch.randint(0, 10, (2560,), generator=g)
        torch.manual_seed(0)
        model = MLP().build(MLPOptions(hidden=[256, 128], dropout=0.0), digits.info(None))
        history = trainer.train(
            ddp, model, TrainData(x, y, x[:64], y[:64]), TrainConfig(epochs=1, batch_size=32), ctx, DDPOptions()
        ).history
        return history.diagnosis, history.epochs[-1].grad_comm_fraction


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_workers_that_mostly_communicate_are_told_so_with_the_knobs():
    (diagnosis, fraction), _ = run_on_ranks(_diagnosis_on_the_digits_mlp, 2, timeout=90)
    assert fraction >= 0.25, fraction
    assert diagnosis.startswith(
        f"communication-bound: gradient all-reduces are in flight {fraction:.0%} of each step on 2 workers"
    )
    assert (
        "train.batch_size, now 32" in diagnosis
        and "FLYSCALE_NPROC_PER_NODE" in diagnosis
        and "bucket_cap_mb" in diagnosis
    )


def test_the_communication_warning_needs_several_workers_and_a_large_share():
    def epoch(comm: float) -> EpochMetrics:
        return EpochMetrics(0, 1.0, None, 1.0, 0.5, 1.0, 1000.0, grad_comm_fraction=comm)

    cfg = TrainConfig()
    assert diagnose(epoch(0.6), cfg, world_size=2).startswith("communication-bound")
    assert diagnose(epoch(0.6), cfg, world_size=1) == ""  # nobody to talk to: no all-reduce
    assert diagnose(epoch(0.1), cfg, world_size=2) == ""  # where 2 workers matched one process


def test_the_diagnosis_rests_on_the_steady_epochs_as_the_scaling_studys_worker_advice_does():
    """A first epoch busy warming up is not a communication-bound training; the steady epochs'
    median is what both the diagnosis and the study's throughput (plan.throughput) use."""
    from flyscale.scaling.plan import throughput
    from flyscale.train.telemetry import diagnose_epochs

    def epochs(comm: list[float]) -> list[EpochMetrics]:
        return [EpochMetrics(i, 1.0, None, 1.0, 0.5, 1.0, 1000.0 + i, grad_comm_fraction=c) for i, c in enumerate(comm)]

    cfg = TrainConfig()
    assert diagnose_epochs(epochs([0.9, 0.1, 0.12, 0.08]), cfg, world_size=2) == ""  # only warm-up was busy
    said = diagnose_epochs(epochs([0.1, 0.4, 0.5, 0.45, 0.2]), cfg, world_size=2)
    assert said.startswith(
        "communication-bound: gradient all-reduces are in flight 43% of each step (median of 4 epochs"
    )
    assert "quartiles 35%-46%" in said and "(1,002 samples/s)" in said  # the same median epoch the study takes
    assert throughput([m.samples_per_s for m in epochs([0.1] * 5)])[0] == 1002.5
