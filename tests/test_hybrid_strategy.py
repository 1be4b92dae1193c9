"""The hybrid strategy on 4 real gloo ranks computes what one process computes over the global
batch: a GPT on a 2 x 2 mesh of data parallelism (FSDP) with tensor parallelism (with clipping,
gradient accumulation and a warm-up), and with pipeline parallelism (clipping and warm-up; the
pipeline refuses accumulation). Each rank holds only its part of the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flyscale.api import DatasetInfo
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train import meta, trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import process_group
from flyscale.train.loop import Hooks
from flyscale_plugins.strategies.hybrid import HybridOptions, hybrid
from tests.distributed_helpers import run_on_ranks
from tests.test_fsdp_strategy import INFO, VOCAB, _data

B, STEPS, DP = 4, 4, 2  # rows per replica and step; optimizer steps; replicas
RTOL, ATOL = 1e-5, 4e-5  # as the other strategies' equivalence tests
TIED = {"layers": 2, "heads": 2, "width": 32}
UNTIED = {**TIED, "tie_embeddings": False}  # a pipeline puts the embedding and the head on different stages

CFG = TrainConfig(
    strategy="hybrid",
    options={"mesh": {"dp": DP, "tp": 2}},
    epochs=1,
    batch_size=B,
    lr=1e-2,
    seed=3,
    grad_clip_norm=0.5,
    warmup_epochs=0.5,
)
TP_CFG = dataclasses.replace(CFG, grad_accum_steps=2)


def _gpt(options: dict, on_meta: bool = True):
    return build_model(ModelConfig(name="gpt", options=options), INFO, meta=on_meta)


def _reference(model_options: dict, cfg: TrainConfig) -> tuple[dict, list[float]]:
    """A plain loop over the global batch (DP x B rows): the same initial weights (per-layer
    seeds), order, AdamW, clipping and warm-up."""
    model = meta.materialise(_gpt(model_options), "cpu", cfg.seed)
    data = _data(DP * B * STEPS)
    order = torch.randperm(DP * B * STEPS, generator=torch.Generator().manual_seed(cfg.seed))  # DistributedSampler's
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / round(cfg.warmup_epochs * STEPS)))
    losses = []
    for step in range(STEPS):
        x = data.x_train[order[step * DP * B : (step + 1) * DP * B]]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        opt.step()
        sched.step()
        losses.append(float(loss))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _hybrid_rank(model_options: dict, cfg: TrainConfig, options: HybridOptions):
    with process_group(timeout_s=60) as ctx:
        result = trainer.train(hybrid, _gpt(model_options), _data(DP * B * STEPS), cfg, ctx, options)
        state = {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None
        return state, result.history.state_mb, result.history.epochs[0]


@pytest.fixture(scope="module")
def dp_tp():
    return run_on_ranks(_hybrid_rank, 4, TIED, TP_CFG, HybridOptions(mesh={"dp": DP, "tp": 2}), timeout=200)


@pytest.fixture(scope="module")
def dp_pp():
    options = HybridOptions(mesh={"dp": DP, "pp": 2}, microbatches=2)
    return run_on_ranks(_hybrid_rank, 4, UNTIED, CFG, options, timeout=200)


def _assert_matches(result, model_options: dict, cfg: TrainConfig) -> None:
    (state, _, epoch), *_ = result
    reference, losses = _reference(model_options, cfg)
    assert set(state) == set(reference)
    for name, ref in reference.items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)
    assert epoch.train_loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert epoch.samples == DP * B * STEPS  # every row counted once, though 4 ranks computed on it
    start = meta.materialise(_gpt(model_options), "cpu", cfg.seed)
    assert not torch.allclose(reference["0.tok"], start.state_dict()["0.tok"])  # the weights did move


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_dp_by_tp_on_4_ranks_matches_one_process_with_the_global_batch(dp_tp):
    _assert_matches(dp_tp, TIED, TP_CFG)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_dp_by_pp_on_4_ranks_matches_one_process_with_the_global_batch(dp_pp):
    _assert_matches(dp_pp, UNTIED, CFG)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_each_rank_holds_about_a_quarter_of_the_state_under_fsdp_on_both_meshes(dp_tp, dp_pp):
    for result in (dp_tp, dp_pp):  # their data-parallel collectives are timed, as fsdp's are
        assert 0 < result[0][2].grad_comm_fraction <= 1.0, result[0][2]
    for result, options in ((dp_tp, TIED), (dp_pp, UNTIED)):
        whole = sum(p.numel() for p in meta.materialise(_gpt(options), "cpu", 0).parameters()) * 4 * 4 / 2**20
        state_mb = result[0][1]
        assert len(state_mb) == 4
        assert max(state_mb) < 0.4 * whole, (state_mb, whole)  # parameters, gradients, Adam's two moments


TABLE = DatasetInfo("table", 3, [8], [f"f{i}" for i in range(8)])
MLP = {"hidden": [16], "dropout": 0.0}
MLP_PLAN = {"0": "colwise", "3": "rowwise"}  # an MLP declares no plan: the config gives one


def _mlp():
    return build_model(ModelConfig(name="mlp", options=MLP), TABLE, meta=True)


def _table(rows: int) -> TrainData:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(rows + 16, 8, generator=g), torch.randint(0, 3, (rows + 16,), generator=g)
    return TrainData(x[:rows], y[:rows], x[rows:], y[rows:])


def _mlp_rank(cfg: TrainConfig, options: HybridOptions):
    with process_group(timeout_s=60) as ctx:
        result = trainer.train(hybrid, _mlp(), _table(DP * B * STEPS), cfg, ctx, options)
        return {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_replicated_data_parallelism_with_the_configs_tp_plan_matches_one_process():
    options = HybridOptions(mesh={"dp": DP, "tp": 2}, data_parallel="replicate", tp_plan=MLP_PLAN)
    state = run_on_ranks(_mlp_rank, 4, TP_CFG, options, timeout=200)[0]
    model = meta.materialise(_mlp(), "cpu", TP_CFG.seed)
    data = _table(DP * B * STEPS)
    order = torch.randperm(DP * B * STEPS, generator=torch.Generator().manual_seed(TP_CFG.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=TP_CFG.lr, weight_decay=TP_CFG.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / round(TP_CFG.warmup_epochs * STEPS)))
    for step in range(STEPS):
        idx = order[step * DP * B : (step + 1) * DP * B]
        opt.zero_grad()
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TP_CFG.grad_clip_norm)
        opt.step()
        sched.step()
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)


def test_options_name_what_is_wrong_with_a_mesh():
    with pytest.raises(ValueError, match=r"one model dimension, pp \(pipeline\) or tp"):
        HybridOptions(mesh={"dp": 2, "pp": 2, "tp": 2})
    with pytest.raises(ValueError, match="got {'dp': 2, 'ep': 2}"):
        HybridOptions(mesh={"dp": 2, "ep": 2})
    with pytest.raises(ValueError, match=r"tp_plan styles must be one of colwise, rowwise, got \{'0': 'sideways'\}"):
        HybridOptions(mesh={"tp": 2}, tp_plan={"0": "sideways"})
    with pytest.raises(ValueError, match=r"mesh \{'dp': 2, 'pp': 2\} needs 4 workers, and this run has 2"):
        HybridOptions(mesh={"dp": 2, "pp": 2}).degrees(2)
    assert HybridOptions(mesh={"tp": 2}).degrees(6) == (3, 2)  # dp left to the job's size
    assert HybridOptions(mesh={"tp": 2}).workers() is None
    cfg = TrainConfig(strategy="hybrid", options={"mesh": {"dp": 3, "pp": 2}})
    assert cfg.workers() == 6 and TrainConfig(strategy="fsdp").workers() is None


def test_a_model_that_cannot_take_the_plan_is_refused_naming_the_layer():
    options = HybridOptions(mesh={"dp": 1, "tp": 2}, tp_plan={"0": "colwise", "1": "rowwise"})
    with pytest.raises(
        ValueError,
        match=r"tp_plan of Sequential names '1', a ReLU, rowwise: flyscale's tensor parallelism splits only nn.Linear",
    ):
        hybrid.check(_mlp(), CFG, options, 2)
    with pytest.raises(ValueError, match=r"no module of this Sequential declares a tp_plan"):
        hybrid.check(_mlp(), CFG, HybridOptions(mesh={"dp": 1, "tp": 2}), 2)


def _resumable_rank(root: str, die_at: int):
    from tests.test_fsdp_strategy import _DiesAfter, _Killed

    options = HybridOptions(mesh={"dp": DP, "pp": 2}, microbatches=2)
    with process_group(timeout_s=60) as ctx:
        ckpt = _DiesAfter(Path(root), die_at, every_steps=2)
        try:
            result = trainer.train(
                hybrid, _gpt(UNTIED), _data(DP * B * STEPS), CFG, ctx, options, Hooks(checkpointer=ckpt)
            )
        except _Killed as killed:
            saved = Path(str(killed))
            return "killed", sorted(p.name for p in (saved / "state").iterdir()) if ctx.is_main else []
        state = {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None
        return state, result.history.resumed_from_step


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_killed_dp_by_pp_run_resumes_from_its_sharded_checkpoint_to_the_same_weights(dp_pp, tmp_path):
    """Killed after the checkpoint of step 2 of 4: each of the 4 ranks wrote its own piece of its
    stage, and the run resumed on the same mesh ends with the uninterrupted run's weights."""
    (killed, files), *_ = run_on_ranks(_resumable_rank, 4, str(tmp_path), 2, timeout=200)
    assert killed == "killed"
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    (resumed, step), *_ = run_on_ranks(_resumable_rank, 4, str(tmp_path), 0, timeout=200)
    assert step == 2
    (whole, _, _), *_ = dp_pp
    for name, ref in whole.items():
        torch.testing.assert_close(resumed[name], ref, rtol=0, atol=0, msg=name)
