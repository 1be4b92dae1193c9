"""The fsdp strategy (FSDP2) computes what one process computes, while each rank holds only its
shards: a tied GPT at world size 2, built on the meta device, against a plain loop over the
doubled batch from the same per-layer initial weights, with clipping, gradient accumulation and
a warm-up schedule. Its checkpoints (DCP) resume exactly after a kill, and, like ddp's, on
another number of workers with the global batch kept; real gloo ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.train import meta, trainer
from flyscale.train.batches import TrainData
from flyscale.train.checkpoint import Checkpointer
from flyscale.train.distributed import process_group
from flyscale.train.loop import Hooks
from flyscale.train.telemetry import COMM_WARNING, EpochMetrics, InFlight, diagnose, state_bytes
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.fsdp import FSDPOptions, fsdp, fsdp_knobs
from tests.distributed_helpers import run_on_ranks

VOCAB, SEQ = 17, 17
INFO = DatasetInfo(
    "tokens",
    0,
    [SEQ],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [SEQ], range=[0, VOCAB - 1])],
    input_field="tokens",
)
B, STEPS = 4, 4  # per-rank batch; optimizer steps
RTOL, ATOL = 1e-5, 4e-5  # as the other strategies' equivalence tests


def _gpt(on_meta: bool = True):
    options = {"layers": 2, "heads": 2, "width": 32}  # tied embeddings, as the presets train it
    return build_model(ModelConfig(name="gpt", options=options), INFO, meta=on_meta)


def _data(rows: int) -> TrainData:
    g = torch.Generator().manual_seed(1)
    x = torch.cumsum(torch.randint(0, 3, (rows + 8, SEQ), generator=g), dim=1) % VOCAB
    empty = torch.zeros(len(x), dtype=torch.long)
    lm = registry.objectives.get("language_modeling")
    return TrainData(x[:rows], empty[:rows], x[rows:], empty[rows:], objective=lm)


def _reference(cfg: TrainConfig, rows: int, batch: int) -> tuple[dict, list[float]]:
    """A plain loop over the global batch: the same initial weights (per-layer seeds), order,
    AdamW, clipping and warm-up."""
    model = meta.materialise(_gpt(), "cpu", cfg.seed)
    data = _data(rows)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(cfg.seed))  # DistributedSampler's
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = round(cfg.warmup_epochs * STEPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    losses = []
    for step in range(STEPS):
        x = data.x_train[order[step * batch : (step + 1) * batch]]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        opt.step()
        sched.step()
        losses.append(float(loss))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _fsdp_rank(cfg: TrainConfig, options: FSDPOptions):
    with process_group(timeout_s=60) as ctx:
        result = trainer.train(fsdp, _gpt(), _data(2 * B * STEPS), cfg, ctx, options)
        state = {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None
        history = (vars(result.history.epochs[0]), result.history.diagnosis)
        return state, result.history.state_mb, result.history.epochs[0].train_loss, history


CFG = TrainConfig(
    strategy="fsdp",
    epochs=1,
    batch_size=B,
    lr=1e-2,
    seed=3,
    grad_clip_norm=0.5,
    grad_accum_steps=2,
    warmup_epochs=0.5,
)


@pytest.fixture(scope="module")
def trained():
    return run_on_ranks(_fsdp_rank, 2, CFG, FSDPOptions(), timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_fsdp_at_world_size_2_matches_one_process_with_the_doubled_batch(trained):
    (state, _, train_loss, _), _ = trained
    reference, losses = _reference(CFG, 2 * B * STEPS, 2 * B)
    assert set(state) == set(reference)
    for name, ref in reference.items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)
    assert train_loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    start = meta.materialise(_gpt(), "cpu", CFG.seed)
    assert not torch.allclose(reference["0.tok"], start.state_dict()["0.tok"])  # the weights did move


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_each_rank_holds_half_of_the_parameters_gradients_and_optimizer_state(trained):
    (_, state_mb, _, _), _ = trained
    model = meta.materialise(_gpt(), "cpu", CFG.seed)
    opt = torch.optim.AdamW(model.parameters())
    model(_data(8).x_train[:2, :-1]).sum().backward()
    opt.step()
    whole = state_bytes(model, opt) / 2**20  # one process's parameters, gradients and Adam state
    for mb in state_mb:
        assert 0.4 * whole < mb < 0.6 * whole, (state_mb, whole)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_all_gathers_and_reduce_scatters_are_timed_and_a_communication_bound_run_is_told_its_knobs(trained):
    """A tiny GPT on gloo: the collectives are timed, in flight for a part of each step and never
    longer than it, and the run's diagnosis says so exactly when that part reaches COMM_WARNING.
    This run sits about the threshold (0.17 to 0.30 of each step on 2 cores, alone or beside the
    suite), so what a communication-bound fsdp run is told, fsdp's own knobs and not DDP's, is
    checked on its epoch with the share set above the threshold."""
    (_, _, _, (epoch, diagnosis)), _ = trained
    fraction = epoch["grad_comm_fraction"]
    assert 0.05 <= fraction <= 1.0, epoch
    told = "communication-bound: parameter all-gathers and gradient reduce-scatters are in flight"
    assert diagnosis.startswith(told) == (fraction >= COMM_WARNING), (fraction, diagnosis)
    bound = EpochMetrics(**{**epoch, "grad_comm_fraction": 2 * COMM_WARNING})
    said = diagnose(bound, CFG, 2, InFlight("parameter all-gathers and gradient reduce-scatters", fsdp_knobs))
    assert said.startswith(told), said
    assert "train.options.reshard_after_forward: false" in said and "bucket_cap_mb" not in said


class _Killed(Exception):
    pass


class _DiesAfter(Checkpointer):
    """Checkpoints as told, then the job dies right after writing step `at`."""

    def __init__(self, root: Path, at: int, **kwargs):
        super().__init__(root, **kwargs)
        self.at = at

    def save(self, state, position, ctx, strategy):
        path = super().save(state, position, ctx, strategy)
        if position.step == self.at:
            raise _Killed(str(path))
        return path


def _resumable_rank(cfg: TrainConfig, root: str, die_at: int, asynchronous: bool = False):
    with process_group(timeout_s=60) as ctx:
        ckpt = _DiesAfter(Path(root), die_at, every_steps=3, asynchronous=asynchronous) if root else None
        try:
            result = trainer.train(
                fsdp, _gpt(), _data(2 * B * STEPS), cfg, ctx, FSDPOptions(), Hooks(checkpointer=ckpt)
            )
        except _Killed:
            if not ctx.is_main:  # rank 0 commits (renames) the checkpoint: only it may look
                return "killed", []
            committed = sorted(p for p in Path(root).glob("step-*") if p.suffix != ".partial")
            return "killed", [str(p.relative_to(root)) for p in committed[-1].rglob("*") if p.is_file()]
        state = {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None
        return state, result.history.resumed_from_step


@pytest.fixture(scope="module")
def uninterrupted_two_epochs():
    (whole, _), _ = run_on_ranks(_resumable_rank, 2, dataclasses.replace(CFG, epochs=2), "", 0, timeout=150)
    return whole


@pytest.mark.timeout(240)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_from_its_sharded_checkpoint_to_the_same_weights(
    uninterrupted_two_epochs, tmp_path, asynchronous
):
    """8 steps, a checkpoint every 3. Saved synchronously, the job dies right after step 3's and
    resumes from it. Saved asynchronously, it dies right after step 6's save began, while that
    one is still being written: it is never committed, and the run resumes from step 3's."""
    cfg = dataclasses.replace(CFG, epochs=2)
    die_at = 6 if asynchronous else 3
    (killed, files), _ = run_on_ranks(_resumable_rank, 2, cfg, str(tmp_path), die_at, asynchronous, timeout=150)
    assert killed == "killed"
    # Each rank wrote its own shards through DCP; nobody wrote the whole model.
    assert sorted(f for f in files if "/state/" in f) == [
        "step-000000003/state/.metadata",
        "step-000000003/state/__0_0.distcp",
        "step-000000003/state/__1_0.distcp",
    ]
    assert "step-000000003/manifest.json" in files
    (resumed, step), _ = run_on_ranks(_resumable_rank, 2, cfg, str(tmp_path), 0, asynchronous, timeout=150)
    assert step == 3
    for name, ref in uninterrupted_two_epochs.items():
        torch.testing.assert_close(resumed[name], ref, rtol=0, atol=0, msg=name)


def _resharding_rank(cfg: TrainConfig, root: str, die_at: int, rows: int, strategy: str = "fsdp"):
    """As the training task does: the checkpointer records the global batch, and a checkpoint
    of another world size is resumed with it kept (the per-worker batch adapted). `ddp`: the
    same per-layer initial weights, built in memory."""
    with process_group(timeout_s=60) as ctx:
        ckpt = _DiesAfter(Path(root), die_at, every_steps=3, global_batch=cfg.batch_size * ctx.world_size)
        plan = ckpt.reshard_plan(ctx)
        cfg = plan.apply(cfg) if plan is not None else cfg
        try:
            hooks = Hooks(checkpointer=ckpt)
            if strategy == "fsdp":
                result = trainer.train(fsdp, _gpt(), _data(rows), cfg, ctx, FSDPOptions(), hooks)
            else:
                model = meta.materialise(_gpt(), "cpu", cfg.seed)
                result = trainer.train(
                    ddp, model, _data(rows), dataclasses.replace(cfg, strategy="ddp"), ctx, DDPOptions(), hooks
                )
        except _Killed:
            return "killed"
        state = {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None
        epochs = [(m.train_loss, m.samples) for m in result.history.epochs]
        return state, epochs, result.history.resharded, cfg.batch_size


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, world", [("fsdp", 1), ("fsdp", 3), ("ddp", 1)])
@pytest.mark.slow
def test_a_checkpoint_of_two_workers_resumes_resharded_on_one_or_three(tmp_path, strategy, world):
    """Global batch 12 (6 a worker on 2); 4 steps an epoch, 2 epochs; killed after step 3, mid-epoch.
    Resumed on `world` workers the run keeps the global batch and the epoch's rows, and ends
    where the uninterrupted run ends (to the tolerance of a different reduction order)."""
    cfg = dataclasses.replace(CFG, epochs=2, batch_size=6, grad_accum_steps=1)
    rows = 12 * 4
    whole, whole_epochs, _, _ = run_on_ranks(
        _resharding_rank, 2, cfg, str(tmp_path / "whole"), 0, rows, strategy, timeout=150
    )[0]
    assert (
        run_on_ranks(_resharding_rank, 2, cfg, str(tmp_path / "cut"), 3, rows, strategy, timeout=150) == ["killed"] * 2
    )
    state, epochs, resharded, batch = run_on_ranks(
        _resharding_rank, world, cfg, str(tmp_path / "cut"), 0, rows, strategy, timeout=150
    )[0]
    micro = 2 if world == 1 else 1  # 12 rows a worker on 1, in micro-batches of the 6 each took before
    assert batch == 12 // world
    assert resharded == (
        f"resharded from 2 workers to {world} (the global batch kept: {12 // world} rows a worker, "
        f"{micro} micro-batch{'es' if micro > 1 else ''} a step)"
    )
    for (loss, samples), (want_loss, want_samples) in zip(epochs, whole_epochs, strict=True):
        assert samples == want_samples == rows  # no row of an epoch skipped or seen twice
        assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, ref in whole.items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)


def test_a_global_batch_the_new_worker_count_cannot_split_is_refused_naming_those_that_can():
    from flyscale.train.reshard import ReshardError, plan

    with pytest.raises(
        ReshardError, match=r"global batch of 12 rows, which 5 workers cannot split evenly; .*\(1, 2, 3, 4, 6, 12\)"
    ):
        plan(2, 12, 1, 5)
    kept = plan(2, 12, 2, 1)  # 6 a worker in 2 micro-batches of 3: now 12 in 4 of 3
    assert (kept.batch_size, kept.grad_accum_steps) == (12, 4)


def test_the_units_are_the_blocks_of_a_tied_gpt_or_the_classes_named():
    from flyscale_plugins.strategies.fsdp import units_of

    tied, untied = (
        _gpt(),
        build_model(
            ModelConfig(name="gpt", options={"layers": 2, "heads": 2, "width": 32, "tie_embeddings": False}),
            INFO,
            meta=True,
        ),
    )
    # The embedding and head share a weight: they are sharded with the root, the blocks alone.
    assert [type(m).__name__ for m in units_of(tied, FSDPOptions())] == ["Block", "Block"]
    assert [type(m).__name__ for m in units_of(untied, FSDPOptions())] == ["Embedding", "Block", "Block", "Head"]
    assert [type(m).__name__ for m in units_of(untied, FSDPOptions(units=["Head"]))] == ["Head"]
    with pytest.raises(ValueError, match=r"train.options.units \['Blocks'\] names no module of this model; .*Block"):
        units_of(tied, FSDPOptions(units=["Blocks"]))


def test_fsdp_options_are_checked_when_the_config_is_read():
    from flyscale.config import ConfigError, from_dict

    cfg = from_dict({"train": {"strategy": "fsdp", "options": {"param_dtype": "bf16"}}})
    assert cfg.train.plugin.options == FSDPOptions(param_dtype="bf16")
    with pytest.raises(ConfigError, match=r"train.options.*param_dtype must be one of fp32, bf16, got 'fp16'"):
        from_dict({"train": {"strategy": "fsdp", "options": {"param_dtype": "fp16"}}})
