"""The pipeline strategy against single-process training, with real 2-process gloo groups."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from flyscale.api import DatasetInfo
from flyscale.config import TrainConfig
from flyscale.serving.servers import free_port
from flyscale.train import meta, trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext, process_group, set_epoch
from flyscale.train.evaluator import evaluate_split
from flyscale.train.step import make_optimizer, standard_step
from flyscale_plugins.models import CNNOptions, MLPOptions, cnn, mlp
from flyscale_plugins.strategies.pipeline import (
    PipelineOptions,
    auto_split_points,
    build_stage,
    forward_backward,
    pipeline,
    split_bounds,
    split_model,
    train_loader,
)
from tests.distributed_helpers import as_caller, context

WIDE = (256, 256, 256)  # four Linear layers of which the balanced split puts two on each stage
INFO = DatasetInfo(name="digits", num_classes=10, input_shape=[1, 8, 8], feature_columns=[])
RTOL, ATOL = 1e-5, 4e-5


# ---------------------------------------------------------------- helpers


def _mlp(seed: int = 0, dropout: float = 0.0, hidden=(256, 128)):
    torch.manual_seed(seed)
    return mlp.build(MLPOptions(hidden=list(hidden), dropout=dropout), INFO)


def _batch(n: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def _toy_data(n_train: int = 72, n_val: int = 24) -> TrainData:
    x, y = _batch(n_train + n_val, seed=2)
    return TrainData(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _worker(rank: int, world: int, port: int, out_dir: str, scenario, args: tuple, environ: dict) -> None:
    """Join a gloo group as `rank` and save what `scenario(ctx, *args)` returns."""
    as_caller(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        CUDA_VISIBLE_DEVICES="",  # CPU and gloo even on a GPU machine
    )
    torch.set_num_threads(1)  # two processes share two cores
    with process_group(timeout_s=30) as ctx:
        result = scenario(ctx, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _run_distributed(scenario, *args, out_dir: Path, world: int = 2, timeout_s: float = 90) -> list:
    """Run `scenario` on `world` ranks; every rank's result, in rank order. Never hangs."""
    worker_args = (world, free_port(), str(out_dir), scenario, args, dict(os.environ))
    # Forked from the helpers' forkserver, which imported torch and flyscale once (tests/distributed_helpers.py).
    start_method = context().get_start_method()
    procs = mp.start_processes(_worker, args=worker_args, nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    try:
        # join() re-raises a rank's exception with its traceback and stops the other ranks.
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{scenario.__name__} did not finish within {timeout_s} s (hang?)")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
            p.join()
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def _reference_training(data: TrainData, cfg: TrainConfig, model=None):
    """Plain single-process training on the batches the pipeline strategy sees."""
    model = _mlp(cfg.seed) if model is None else model
    step = standard_step(model, make_optimizer(model, cfg), cfg, torch.device("cpu"))
    loader = train_loader(data, cfg, DistContext())
    epochs = []
    for epoch in range(cfg.epochs):
        set_epoch(loader, epoch)
        sums = [0.0, 0.0, 0]
        for xb, yb in loader:
            loss, correct, rows = step(xb, yb)  # the batch's mean loss
            sums = [sums[0] + float(loss) * rows, sums[1] + float(correct), sums[2] + rows]
        epochs.append((sums[0] / sums[2], sums[1] / sums[2]))
    return model, epochs


# ------------------------------------------------------- distributed scenarios (run in each rank)


def _one_step_each_schedule(ctx: DistContext, x, y) -> dict:
    out = {}
    for schedule in ("gpipe", "1f1b"):
        stage = build_stage(_mlp(), ctx, PipelineOptions(schedule=schedule, microbatches=4))
        loss, correct = forward_backward(stage, x, y)
        grads = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
        out[schedule] = {"loss": float(loss), "correct": float(correct), "grads": grads}
    return out


def _repeated_steps(ctx: DistContext, x, y, runs: int) -> list[float]:
    losses = []
    for i in range(runs):
        schedule = ("gpipe", "1f1b")[i % 2]
        stage = build_stage(_mlp(hidden=(32,)), ctx, PipelineOptions(schedule=schedule, microbatches=2))
        losses.append(float(forward_backward(stage, x, y)[0]))
    return losses


def _meta_mlp(hidden=WIDE):
    with torch.device("meta"):  # as the training task builds it for the pipeline strategy
        return mlp.build(MLPOptions(hidden=list(hidden), dropout=0.0), INFO)


def _train_meta(ctx: DistContext, data: TrainData, cfg: TrainConfig, options: PipelineOptions) -> dict:
    model = _meta_mlp()
    result = trainer.train(pipeline, model, data, cfg, ctx, options)
    return {
        "state": {k: v.detach().cpu() for k, v in result.model.state_dict().items() if not v.is_meta},
        "meta_layers": [i for i, layer in enumerate(result.model) if meta.is_meta(layer)],
        "state_mb": result.history.state_mb,
        "epochs": [asdict(m) for m in result.history.epochs],
    }


def _train(ctx: DistContext, data: TrainData, cfg: TrainConfig, options: PipelineOptions, dropout: float) -> dict:
    result = trainer.train(pipeline, _mlp(cfg.seed, dropout=dropout), data, cfg, ctx, options)
    state = {k: v.detach().cpu() for k, v in result.model.state_dict().items()}
    return {"state": state, "epochs": [asdict(m) for m in result.history.epochs], "world": result.history.world_size}


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(150)  # spawned gloo workers on a shared 2-core machine
@pytest.mark.slow
def test_one_step_matches_single_process_for_both_schedules(tmp_path):
    x, y = _batch(16)
    ref = _mlp()
    logits = ref(x)
    ref_loss = F.cross_entropy(logits, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    ranks = _run_distributed(_one_step_each_schedule, x, y, out_dir=tmp_path)

    for schedule in ("gpipe", "1f1b"):
        first, last = ranks[0][schedule], ranks[1][schedule]
        assert first["loss"] == 0.0  # only the last stage computes the loss
        torch.testing.assert_close(torch.tensor(last["loss"]), ref_loss.detach(), rtol=RTOL, atol=ATOL)
        assert last["correct"] == float((logits.argmax(1) == y).sum())
        # The two stages own disjoint parameters that together are the whole model's.
        assert not set(first["grads"]) & set(last["grads"])
        assert set(first["grads"]) | set(last["grads"]) == set(ref_grads)
        assert first["grads"] and last["grads"]
        for name, grad in {**first["grads"], **last["grads"]}.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=f"{schedule} {name}")


@pytest.mark.timeout(150)  # spawned gloo workers on a shared 2-core machine
# With clipping the update depends on the norm of the WHOLE model's gradient, though each rank
# holds one stage: per-stage clipping would fail this comparison.
@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no-clip", "global-clip"])
@pytest.mark.slow
def test_training_matches_single_process_weights_and_metrics(tmp_path, clip):
    data = _toy_data()  # 72 rows: 4 full batches of 16 per epoch, the partial one is dropped
    cfg = TrainConfig(
        strategy="pipeline", epochs=2, batch_size=16, lr=1e-2, seed=3, grad_clip_norm=clip, track_train_accuracy=True
    )
    ref_model, ref_epochs = _reference_training(data, cfg)
    v_loss, v_correct, v_count = evaluate_split(ref_model, data.x_val, data.y_val, DistContext())()

    options = PipelineOptions(schedule="1f1b", microbatches=4)
    rank0, rank1 = _run_distributed(_train, data, cfg, options, 0.0, out_dir=tmp_path)
    alone = _train(DistContext(), data, cfg, options, 0.0)  # world_size 1: one stage, plain steps

    # Rank 1 trained its stage only; rank 0 assembled the whole model.
    last_stage = set(split_model(_mlp(), 2, [])[1].state_dict())
    for run, names in ((rank0, ref_model.state_dict()), (rank1, last_stage), (alone, ref_model.state_dict())):
        for name in names:
            torch.testing.assert_close(run["state"][name], ref_model.state_dict()[name], rtol=RTOL, atol=ATOL, msg=name)
    for run in (rank0, rank1, alone):
        for got, (ref_loss, ref_acc) in zip(run["epochs"], ref_epochs, strict=True):
            assert got["train_loss"] == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
            assert got["train_accuracy"] == pytest.approx(ref_acc)
        assert run["epochs"][-1]["val_loss"] == pytest.approx(v_loss / v_count, rel=RTOL, abs=ATOL)
        assert run["epochs"][-1]["val_accuracy"] == pytest.approx(v_correct / v_count)
    assert rank0["world"] == 2 and alone["world"] == 1


@pytest.mark.timeout(150)  # spawned gloo workers on a shared 2-core machine
@pytest.mark.slow
def test_interleaved_1f1b_runs_two_stages_a_rank_and_trains_as_one_process(tmp_path):
    """Four stages on two ranks (rank 0 runs stages 0 and 2, rank 1 stages 1 and 3), torch's
    interleaved 1F1B schedule: the same weights, losses and validation as one process, with
    clipping by the global norm; rank 1 never holds stage 0's or 2's layers."""
    data = _toy_data()
    cfg = TrainConfig(
        strategy="pipeline", epochs=2, batch_size=16, lr=1e-2, seed=3, grad_clip_norm=0.05, track_train_accuracy=True
    )
    options = PipelineOptions(schedule="interleaved_1f1b", microbatches=4)
    ref_model, ref_epochs = _reference_training(data, cfg, meta.materialise(_meta_mlp(), "cpu", cfg.seed))
    v_loss, v_correct, v_count = evaluate_split(ref_model, data.x_val, data.y_val, DistContext())()
    rank0, rank1 = _run_distributed(_train_meta, data, cfg, options, out_dir=tmp_path)
    bounds = split_bounds(_meta_mlp(), 4, [])
    others = [i for s in (0, 2) for i in range(bounds[s], bounds[s + 1]) if list(_meta_mlp()[i].parameters())]
    assert rank1["meta_layers"] == others and len(others) == 2
    for name, ref in ref_model.state_dict().items():
        torch.testing.assert_close(rank0["state"][name], ref, rtol=RTOL, atol=ATOL, msg=name)
    for got, (ref_loss, ref_acc) in zip(rank0["epochs"], ref_epochs, strict=True):
        assert got["train_loss"] == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
        assert got["train_accuracy"] == pytest.approx(ref_acc)
    assert rank0["epochs"][-1]["val_loss"] == pytest.approx(v_loss / v_count, rel=RTOL, abs=ATOL)
    assert rank0["epochs"][-1]["val_accuracy"] == pytest.approx(v_correct / v_count)


@pytest.mark.timeout(150)  # spawned gloo workers on a shared 2-core machine
@pytest.mark.slow
def test_meta_built_stages_hold_only_their_layers_and_train_as_one_process(tmp_path):
    """Built on the meta device, each rank materialises only its stage: it never holds the other
    stage's layers, its parameters, gradients and AdamW state are at most 0.6x the whole model's,
    and rank 0 assembles at the end the weights one process trains from the same initial weights."""
    data = _toy_data()
    cfg = TrainConfig(
        strategy="pipeline", epochs=2, batch_size=16, lr=1e-2, seed=3, grad_clip_norm=0.05, track_train_accuracy=True
    )
    options = PipelineOptions(schedule="gpipe", microbatches=4)
    ref_model, ref_epochs = _reference_training(data, cfg, meta.materialise(_meta_mlp(), "cpu", cfg.seed))

    rank0, rank1 = _run_distributed(_train_meta, data, cfg, options, out_dir=tmp_path)
    alone = _train_meta(DistContext(), data, cfg, options)

    assert rank1["meta_layers"] == [0, 3]  # stage 0's two Linear layers: never held on rank 1
    assert rank0["meta_layers"] == [] and alone["meta_layers"] == []  # assembled on rank 0
    for run in (rank0, alone):
        assert set(run["state"]) == set(ref_model.state_dict())
        for name, ref in ref_model.state_dict().items():
            torch.testing.assert_close(run["state"][name], ref, rtol=RTOL, atol=ATOL, msg=name)
    for got, (ref_loss, _) in zip(rank0["epochs"], ref_epochs, strict=True):
        assert got["train_loss"] == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
    whole = alone["state_mb"][0]
    params = sum(p.numel() for p in ref_model.parameters()) * 4 / 2**20
    assert whole == pytest.approx(4 * params, rel=0.01)  # weights, gradients, AdamW's two moments
    assert len(rank0["state_mb"]) == 2 and rank0["state_mb"] == rank1["state_mb"]  # every rank's, everywhere
    assert max(rank0["state_mb"]) <= 0.6 * whole
    assert sum(rank0["state_mb"]) == pytest.approx(whole, rel=0.01)  # split, nothing held twice


def test_a_layer_that_cannot_initialise_itself_is_named():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            return x * self.weight

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), Scale(), torch.nn.Linear(64, 10))
    with pytest.raises(ValueError, match=r"layer 1, a Scale, .*no reset_parameters"):
        meta.materialise(model, "cpu", seed=0)


def test_materialised_layers_do_not_depend_on_which_others_are():
    alone = meta.materialise(_meta_mlp(), "cpu", seed=5, layers=[6])
    every = meta.materialise(_meta_mlp(), "cpu", seed=5)
    other = meta.materialise(_meta_mlp(), "cpu", seed=6)
    assert [i for i, layer in enumerate(alone) if meta.is_meta(layer)] == [0, 3, 9]  # the other Linear layers
    torch.testing.assert_close(alone[6].weight, every[6].weight, rtol=0, atol=0)
    assert not torch.equal(every[6].weight, other[6].weight)
    assert not torch.equal(every[0].weight[:, :10], every[3].weight[:, :10])  # each layer its own draw


@pytest.mark.timeout(150)  # spawned gloo workers on a shared 2-core machine
@pytest.mark.slow
def test_twenty_fresh_pipelines_run_without_hanging(tmp_path):
    x, y = _batch(8)
    with torch.no_grad():
        expected = float(F.cross_entropy(_mlp(hidden=(32,))(x), y))
    start = time.monotonic()
    first, last = _run_distributed(_repeated_steps, x, y, 20, out_dir=tmp_path, timeout_s=40)
    assert first == [0.0] * 20
    # Every fresh pipeline starts from the same weights, so a stale buffer would show as a wrong loss.
    assert last == pytest.approx([expected] * 20, rel=RTOL, abs=ATOL)
    assert time.monotonic() - start < 40


def _compose(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize(
    "model, expected_points",
    [
        # MLP: Linear(64,256) | ReLU Dropout Linear(256,128) ... keeps each activation with its layer.
        (mlp.build(MLPOptions(), INFO), [3]),
        # CNN: the 4096x128 Linear dominates, so the convolutions form stage 0.
        (cnn.build(CNNOptions(), INFO), [6]),
    ],
    ids=["mlp", "cnn"],
)
def test_automatic_split_composes_to_the_full_model(model, expected_points):
    model.eval()
    assert auto_split_points(model, 2) == expected_points
    stages = split_model(model, 2, [])
    assert sum(len(s) for s in stages) == len(model)
    assert all(any(True for _ in s.parameters()) for s in stages)
    x = torch.rand(5, 64) * 16
    with torch.no_grad():
        torch.testing.assert_close(_compose(stages, x), model(x))
    three = split_model(model, 3, [])
    with torch.no_grad():
        torch.testing.assert_close(_compose(three, x), model(x))


def test_equal_layers_split_by_layer_count():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    assert auto_split_points(model, 2) == [3]
    assert auto_split_points(model, 3) == [2, 4]


@pytest.mark.parametrize(
    "make",
    [
        lambda m: PipelineOptions(split_points=[3, 3]),  # not strictly increasing
        lambda m: PipelineOptions(split_points=[0]),  # stage 0 would be empty
        lambda m: split_model(m, 2, [7]),  # past the last layer (the MLP has 7)
        lambda m: split_model(m, 2, [1, 3]),  # two points for two stages
        lambda m: split_model(m, 3, [1, 3]),  # stage 1 = ReLU, Dropout: nothing to train
        lambda m: TrainConfig(strategy="pipeline", options={"split_points": [4, 2]}),
    ],
)
def test_bad_split_points_name_the_field(make):
    with pytest.raises(ValueError, match="split_points"):
        make(_mlp())


def test_bad_options_name_the_field_and_alternatives():
    with pytest.raises(ValueError, match=r"schedule must be one of gpipe, 1f1b"):
        PipelineOptions(schedule="zigzag")
    with pytest.raises(ValueError, match="microbatches"):
        PipelineOptions(microbatches=0)
    cfg = TrainConfig(strategy="pipeline", epochs=1, batch_size=10)
    with pytest.raises(ValueError, match="microbatches"):
        trainer.train(pipeline, _mlp(), _toy_data(), cfg, DistContext(), PipelineOptions(microbatches=4))


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_two_stages_learn_digits_and_rank0_returns_the_complete_model(tmp_path):
    from flyscale_plugins.datasets import digits

    frame = digits.load(None)
    x = torch.tensor(frame.drop(columns="label").to_numpy(), dtype=torch.float32) / 16.0
    y = torch.tensor(frame["label"].to_numpy(), dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    tr, va = perm[:1500], perm[1500:]
    data = TrainData(x[tr], y[tr], x[va], y[va])
    cfg = TrainConfig(strategy="pipeline", epochs=10, batch_size=32, lr=2e-3, seed=0)

    rank0, _ = _run_distributed(_train, data, cfg, PipelineOptions(microbatches=4), 0.1, out_dir=tmp_path, timeout_s=75)

    epochs = rank0["epochs"]
    assert len(epochs) == 10 and epochs[-1]["val_accuracy"] >= 0.9
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    # Complete: every layer of both stages moved away from its initial weights.
    init = _mlp(cfg.seed, dropout=0.1).state_dict()
    assert all(not torch.equal(rank0["state"][k], v) for k, v in init.items())
    # ...and the weights alone reproduce the reported accuracy in a plain single process.
    model = _mlp(dropout=0.1)
    model.load_state_dict(rank0["state"])
    _, correct, count = evaluate_split(model, data.x_val, data.y_val, DistContext())()
    assert correct / count == pytest.approx(epochs[-1]["val_accuracy"])


@pytest.mark.parametrize(
    "field, value", [("grad_accum_steps", 2), ("precision", "bf16"), ("activation_checkpointing", True)]
)
def test_settings_the_pipeline_does_not_apply_are_refused(field, value):
    cfg = TrainConfig(strategy="pipeline", batch_size=16, **{field: value})
    with pytest.raises(ValueError, match=f"train.{field}=.*not supported by the pipeline strategy"):
        trainer.train(pipeline, _mlp(), _toy_data(), cfg, DistContext(), PipelineOptions())


def test_a_model_with_batchnorm_is_refused_naming_the_layer_and_the_way_out():
    """Later stages see micro-batches only: BatchNorm's running statistics would be garbage."""
    model = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    cfg = TrainConfig(strategy="pipeline", batch_size=16)
    with pytest.raises(ValueError, match=r"the model has 1 \(BatchNorm1d\): use LayerNorm or GroupNorm.*ddp"):
        trainer.train(pipeline, model, _toy_data(), cfg, DistContext(), PipelineOptions())
    # Without running statistics it is a per-batch normalisation, which every stage computes right.
    untracked = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16, track_running_stats=False), nn.Linear(16, 10))
    trainer.train(pipeline, untracked, _toy_data(), cfg, DistContext(), PipelineOptions())


def test_the_check_before_data_work_refuses_what_training_would_refuse():
    """`check_model` (the first task's check, on the meta device) refuses, at the world size it
    is given, each thing training itself would refuse later; a model that fits passes."""
    from flyscale.train.strategies import check_model

    class Scale(nn.Module):  # holds a parameter, but cannot initialise it from the meta device
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x * self.weight

    pipe = TrainConfig(strategy="pipeline", batch_size=32, options={"microbatches": 4})
    with torch.device("meta"):
        good = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        unresettable = nn.Sequential(nn.Linear(64, 16), Scale(), nn.Linear(16, 10))
    check_model(good, pipe, 2)
    check_model(nn.Linear(64, 10), TrainConfig(), 4)  # ddp takes any module
    refusals = [
        (unresettable, pipe, 2, r"layer 1, a Scale, .*no reset_parameters"),
        (good, pipe, 4, r"split into 4 pipeline stages|stage \d .* without trainable parameters"),
        (good, TrainConfig(strategy="pipeline", batch_size=30, options={"microbatches": 4}), 2, "divisible"),
        (good, TrainConfig(strategy="pipeline", precision="bf16"), 2, r"train.precision='bf16' is not supported"),
        (nn.Linear(64, 10), TrainConfig(activation_checkpointing=True), 2, "this one is a Linear"),
        (
            nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)),
            TrainConfig(activation_checkpointing=True),
            2,
            r"update the running statistics of BatchNorm layer '1' twice a step",
        ),
    ]
    for model, cfg, world, message in refusals:
        with pytest.raises(ValueError, match=message):
            check_model(model, cfg, world)
