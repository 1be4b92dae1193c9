"""The preflight check passes correct setups and stops broken ones with the numbers.

Every case runs the library function on 2 real gloo processes. Faults are injected the way a
user would ship them: as a strategy plugin registered by name inside the worker processes.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from flyscale.config import ModelConfig, PreflightConfig, TrainConfig
from flyscale.data import tensors as fdata
from flyscale.plugin import registry
from flyscale.train.batches import TrainData, make_loader
from flyscale.train.distributed import process_group
from flyscale.train.evaluator import evaluate_split
from flyscale.train.loop import TrainResult
from flyscale.train.preflight import PreflightReport, compare, run_preflight
from flyscale.train.step import make_optimizer, standard_step
from flyscale.train.strategies import wants_meta_model
from flyscale.train.telemetry import EpochMetrics, TrainHistory
from flyscale.train.trainer import fit
from flyscale_plugins.datasets import digits
from tests.distributed_helpers import run_on_ranks

MODEL = ModelConfig(name="mlp", options={"hidden": [64, 32]})  # default dropout 0.1: the check must cope


def _digits() -> TrainData:
    x, y = fdata.to_tensors(digits.load(None), digits.info(None))
    return TrainData(x[:1500], y[:1500], x[1500:], y[1500:])


def _broken(model, data: TrainData, cfg: TrainConfig, ctx, options, *, sync=True, scale_by_world=True, shard=True):
    """DDP with one of the classic faults: no gradient all-reduce, LR not scaled by world, no sharding."""
    wrapped = DistributedDataParallel(model) if sync else model
    dataset = TensorDataset(data.x_train, data.y_train)
    sampler = ctx.train_sampler(dataset, seed=cfg.seed) if shard else None  # None: every rank reads every row
    loader = make_loader(dataset, sampler, cfg, ctx)
    optimizer = make_optimizer(model, cfg, ctx.world_size if scale_by_world else 1)
    step = standard_step(wrapped, optimizer, cfg, ctx.device)
    evaluate = evaluate_split(model, data.x_val, data.y_val, ctx)
    history = fit(wrapped, step, loader, evaluate, cfg, ctx, "broken", optimizer)
    return TrainResult(model=model, history=history)


BROKEN = {
    "no_allreduce": dict(sync=False),
    "unscaled_lr": dict(scale_by_world=False),
    "unsharded": dict(shard=False),
}


def _preflight_on_rank(cases: list[tuple[str, dict]], steps: int = 5) -> list:
    """One worker: for each (strategy, train config), register it if broken, run the preflight.

    Several cases share one spawned group: starting processes costs more than the check itself.
    Returns [(report, error message)] in case order.
    """
    from flyscale import model as artifacts

    out = []
    with process_group(timeout_s=60) as ctx:
        for strategy, train in cases:
            if strategy in BROKEN:
                registry.strategies.register(strategy, lambda *a, _k=BROKEN[strategy]: _broken(*a, **_k))
            cfg = TrainConfig(strategy=strategy, **train)
            fn, options = cfg.plugin.plugin, cfg.plugin.options
            try:
                out.append(
                    (
                        run_preflight(
                            # As the preflight task builds it: on the meta device for the pipeline strategy.
                            lambda cfg=cfg: artifacts.build_model(MODEL, digits.info(None), meta=wants_meta_model(cfg)),
                            _digits(),
                            cfg,
                            PreflightConfig(enabled=True, steps=steps),
                            ctx,
                            fn,
                            options,
                        ),
                        None,
                    )
                )
            except ValueError as exc:
                out.append((None, str(exc)))
            ctx.barrier()  # rank 1 must not start the next case while rank 0 still runs the reference
    return out


CORRECT = [
    ("ddp", dict(batch_size=32)),  # the defaults: static graph, gradients as bucket views
    # LR scaling, warm-up and gradient accumulation under no_sync: all must still match one process.
    ("ddp", dict(batch_size=32, scale_lr=True, base_batch_size=32, warmup_epochs=2.0, grad_accum_steps=2)),
    ("pipeline", dict(batch_size=64, options={"schedule": "1f1b", "microbatches": 4})),
]


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_correct_setups_pass_with_matching_losses():
    rank0, rank1 = run_on_ranks(_preflight_on_rank, 2, CORRECT)
    assert rank1 == [(None, None)] * len(CORRECT)  # only rank 0 compares and reports
    for (strategy, _), (report, error) in zip(CORRECT, rank0):
        assert error is None, error
        assert isinstance(report, PreflightReport) and report.passed
        assert report.world_size == 2 and report.steps == 5 and report.strategy == strategy
        assert report.max_rel_diff < 1e-5, report.table()  # fp32: rounding only, far below the default rtol
        assert len(report.losses_world1) == len(report.losses_worldN) == 5
        assert report.samples_per_s_world1 > 0 and report.samples_per_s_worldN > 0  # throughput, measured
        # The steps trained: otherwise two untouched models would agree trivially.
        assert report.losses_worldN[-1] < 0.9 * report.losses_worldN[0]


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_broken_setups_fail_fast_with_the_numbers():
    faults = sorted(BROKEN)
    rank0, _ = run_on_ranks(_preflight_on_rank, 2, [(f, dict(batch_size=32, scale_lr=True)) for f in faults])
    for fault, (report, error) in zip(faults, rank0):
        assert report is None and error is not None, f"{fault} passed the preflight"
        assert f"preflight failed: {fault} at world size 2" in error
        assert "Suspect data sharding, learning-rate scaling, gradient synchronisation" in error
        lines = error.splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "loss@1"])
        rows = [line.split() for line in lines[header + 1 :]]
        assert [r[0] for r in rows] == ["1", "2", "3", "4", "5"], error
        # Each fault is far beyond the default rtol (1e-3), not a borderline call.
        assert max(float(r[-1]) for r in rows) > 1e-2, error


def _history(*losses: float) -> TrainHistory:
    h = TrainHistory(strategy="ddp", world_size=4)
    h.epochs = [EpochMetrics(i, loss, 0.5, loss, 0.5, 1.0, 1.0) for i, loss in enumerate(losses)]
    return h


def test_compare_uses_relative_tolerance_on_every_step():
    ok = compare(_history(2.0, 1.5), _history(2.0, 1.5 * (1 + 5e-4)), rtol=1e-3, strategy="ddp")
    assert ok.passed and ok.world_size == 4 and ok.steps == 2
    bad = compare(_history(2.0, 1.5), _history(2.0, 1.5 * (1 + 2e-3)), rtol=1e-3, strategy="ddp")
    assert not bad.passed and bad.max_rel_diff == pytest.approx(3e-3 / 1.503, rel=1e-9)
    assert "   2" in bad.table() and "1.503000" in bad.table()


def test_workers_slower_than_one_process_are_named_with_the_numbers_and_knobs():
    from flyscale.train.preflight import slower_with_workers

    report = PreflightReport(
        passed=True,
        world_size=2,
        steps=5,
        strategy="ddp",
        samples_per_s_world1=15400.0,
        samples_per_s_worldN=13000.0,
        grad_comm_fraction=0.42,
    )
    message = slower_with_workers(report, TrainConfig(batch_size=32))
    assert "2 workers train 13,000 samples/s against 15,400 for one process with the same cores (0.84x)" in message
    assert "communication-bound" in message and "42%" in message
    assert "train.batch_size, now 32" in message and "FLYSCALE_NPROC_PER_NODE" in message and "bucket_cap_mb" in message
    report.samples_per_s_worldN = 20000.0  # faster with workers: nothing to say
    assert slower_with_workers(report, TrainConfig()) == ""


def test_disabled_preflight_returns_at_once():
    from flyscale.train.distributed import DistContext

    def never(*_):
        raise AssertionError("the strategy must not run when preflight is disabled")

    report = run_preflight(never, _digits(), TrainConfig(), PreflightConfig(), DistContext(world_size=3), never, None)
    assert report == PreflightReport.skipped() and report.passed and report.steps == 0


def test_switched_off_task_starts_no_workers(monkeypatch):
    """Off, the task answers in the parent process: no worker group, no seconds of start-up."""
    from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

    from tasks.preflight import preflight_check

    def no_workers(*_, **__):
        raise AssertionError("a switched-off preflight started the worker group")

    monkeypatch.setattr(PytorchElasticFunctionTask, "_execute", no_workers)  # where flytekit starts workers
    frame = digits.load(None).head(64)
    report, ran = preflight_check.execute(
        train=frame,
        val=frame,
        info=digits.info(None),
        model_cfg=MODEL,
        cfg=TrainConfig(),
        preflight_cfg=PreflightConfig(),
    )
    assert report == PreflightReport.skipped() and ran.task == "preflight_check"
    with pytest.raises(AssertionError, match="started the worker group"):  # and on, it would have
        preflight_check.execute(
            train=frame,
            val=frame,
            info=digits.info(None),
            model_cfg=MODEL,
            cfg=TrainConfig(),
            preflight_cfg=PreflightConfig(enabled=True),
        )


def test_auto_trains_on_the_faster_count_keeping_the_global_batch_it_timed():
    from flyscale.train.preflight import choose_workers, keep_global_batch

    timed = dict(passed=True, world_size=2, steps=5, strategy="ddp", grad_comm_fraction=0.5)
    one_faster = choose_workers(PreflightReport(**timed, samples_per_s_world1=6e4, samples_per_s_worldN=3e4), 128)
    assert one_faster.workers == 1 and one_faster.slower_with_workers == ""
    assert one_faster.workers_reason == (
        "1 of 2 (auto: in the preflight one process trained 60,000 samples/s, 2 workers 30,000; "
        "the global batch of 128 rows kept)"
    )
    cfg, said = keep_global_batch(TrainConfig(batch_size=64), one_faster, 1, "unused")
    assert cfg.batch_size == 128 and said == one_faster.workers_reason  # one process takes both workers' rows
    group_faster = choose_workers(PreflightReport(**timed, samples_per_s_world1=3e4, samples_per_s_worldN=5e4), 128)
    assert group_faster.workers == 2 and group_faster.workers_reason.startswith("2 (auto: in the preflight 2 workers")
    assert keep_global_batch(TrainConfig(batch_size=64), group_faster, 2, "unused")[0].batch_size == 64
    # A count auto did not choose (a cluster keeps its registered one): the config as it is, and how it was set.
    cfg, said = keep_global_batch(TrainConfig(batch_size=64), one_faster, 2, "FLYSCALE_NPROC_PER_NODE=2")
    assert cfg.batch_size == 64 and said == "2 (FLYSCALE_NPROC_PER_NODE=2)"


def test_auto_times_the_workers_even_with_the_check_off_but_not_a_pipeline(monkeypatch):
    """FLYSCALE_NPROC_PER_NODE=auto (the default, unset): a switched-off preflight still starts the
    worker group, to time it; a pipeline's stages are its layout, so there is nothing to choose."""
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState
    from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

    from tasks.preflight import preflight_check

    def started(*_, **__):
        raise AssertionError("the worker group started")

    monkeypatch.setattr(PytorchElasticFunctionTask, "_execute", started)
    monkeypatch.delenv("FLYSCALE_NPROC_PER_NODE")
    frame = digits.load(None).head(64)
    kwargs = dict(train=frame, val=frame, info=digits.info(None), model_cfg=MODEL, preflight_cfg=PreflightConfig())
    ctx = FlyteContextManager.current_context()
    local = ctx.with_execution_state(
        ctx.new_execution_state().with_params(mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION)
    )
    with FlyteContextManager.with_context(local):  # as under `pyflyte run`: auto chooses in local runs only
        with pytest.raises(AssertionError, match="the worker group started"):
            preflight_check.execute(cfg=TrainConfig(), **kwargs)
        report, _ = preflight_check.execute(cfg=TrainConfig(strategy="pipeline"), **kwargs)
    assert report == PreflightReport.skipped()
    report, _ = preflight_check.execute(cfg=TrainConfig(), **kwargs)  # in a pod: the registered count
    assert report == PreflightReport.skipped()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", 0, "preflight.steps must be > 0"),
        ("rtol", 0.0, "preflight.rtol must be > 0"),
        ("rtol", 1.5, "preflight.rtol must be < 1"),
    ],
)
def test_preflight_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        PreflightConfig(**{field: value})


def _world_one(strategy, cfg: TrainConfig) -> PreflightReport:
    from flyscale import model as artifacts
    from flyscale.train.distributed import DistContext

    return run_preflight(
        lambda: artifacts.build_model(MODEL, digits.info(None)),
        _digits(),
        cfg,
        PreflightConfig(enabled=True, steps=3),
        DistContext(),
        strategy,
        cfg.plugin.options,
    )


def test_at_world_size_one_the_check_still_compares_two_different_loops():
    """Without spawning: the pipeline strategy's own step (not standard_step) matches the
    reference loop, and a strategy whose optimizer step is wrong is caught even alone."""
    pipeline = TrainConfig(strategy="pipeline", batch_size=16)
    report = _world_one(pipeline.plugin.plugin, pipeline)
    assert report.passed and report.steps == 3 and report.max_rel_diff < 1e-6
    assert torch.tensor(report.losses_world1).argmin() == 2  # three steps down one batch

    def double_lr(model, data, cfg, ctx, options):
        from dataclasses import replace

        return _broken(model, data, replace(cfg, lr=2 * cfg.lr), ctx, options, sync=False)  # alone: no DDP

    with pytest.raises(ValueError, match=r"preflight failed: ddp at world size 1 diverges from one process"):
        _world_one(double_lr, TrainConfig(batch_size=16))
