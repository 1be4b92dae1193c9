"""Ctrl-C keeps the work, on real gloo processes: a signal to one rank stops every rank after
the same step, with one checkpoint there written by all of them, and the run resumes from it;
the automatic checkpoint interval scales with the run and obeys an explicit setting."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits

from flyscale.config import ModelConfig, RecoveryConfig, TrainConfig
from flyscale.model import build_model
from flyscale.train import interrupt, trainer
from flyscale.train.batches import TrainData
from flyscale.train.checkpoint import AUTO_LEAST_S, AUTO_MOST_S, Checkpointer
from flyscale.train.checkpoint_files import complete_checkpoints, step_of
from flyscale.train.distributed import DistContext, process_group
from flyscale.train.interrupt import Interrupted, StepVote, StopSignals
from flyscale.train.loop import Hooks
from flyscale_plugins.datasets import digits
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from tests.distributed_helpers import run_on_ranks

CFG = TrainConfig(epochs=4, batch_size=10, lr=1e-2, seed=0)  # 600 rows: 30 steps an epoch on 2 ranks


def _data() -> TrainData:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    return TrainData(x[:600], y[:600], x[1000:1200], y[1000:1200])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(options={"hidden": [32]}), digits.info(None))


def _rank(root: str, signalled: int, at_step: int, vote_every_s: float, step_sleep_s: float):
    """Train on this rank; rank `signalled` sends itself SIGINT during step `at_step` (a signal
    the others never get). Then the same training again, which resumes."""
    interrupt.VOTE_EVERY_S = vote_every_s
    with process_group(timeout_s=60) as ctx:
        model, steps = _model(), [0]

        def hook(module, _inputs):
            if module.training:  # one forward a step; evaluation's do not count
                steps[0] += 1
                if step_sleep_s:
                    import time

                    time.sleep(step_sleep_s)  # steps slow enough for a vote every few of them
                if ctx.rank == signalled and steps[0] == at_step:
                    os.kill(os.getpid(), signal.SIGINT)

        model.register_forward_pre_hook(hook)
        signals = StopSignals()
        ckpt = Checkpointer(Path(root), every_minutes=None, global_batch=CFG.batch_size * ctx.world_size)
        try:
            with signals.installed():
                trainer.train(ddp, model, _data(), CFG, ctx, DDPOptions(), Hooks(ckpt, signals=signals))
        except Interrupted as exc:
            stopped = (exc.step, exc.signal, Path(exc.checkpoint).name, exc.main, list(ckpt.saved))
        else:
            raise AssertionError(f"rank {ctx.rank} trained to the end: the stop never reached it")
        ctx.barrier()
        resumed = trainer.train(ddp, _model(), _data(), CFG, ctx, DDPOptions(), Hooks(Checkpointer(Path(root))))
        return stopped, signals.received, resumed.history.resumed_from_step, resumed.history.steps


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "world, vote_every_s, step_sleep_s",
    [
        (2, 0.2, 0.01),  # the real cadence: votes ~0.2 s apart, their steps worked out from the summed time
        (3, 0.0, 0.0),  # a vote every step: the stop comes right after the step the signal arrived in
    ],
)
@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(
    tmp_path, world, vote_every_s, step_sleep_s
):
    """The last rank alone gets SIGINT during step 7. Every rank stops after the same step (a rank
    voting at steps of its own would leave its peers waiting in the all-reduce), each writes its
    share of one checkpoint there, and the same training resumes from it."""
    root, last = tmp_path / "ckpt", world - 1
    results = run_on_ranks(_rank, world, str(root), last, 7, vote_every_s, step_sleep_s, timeout=150)
    (step,) = {r[0][0] for r in results}  # every rank after the same step
    assert step == 7 if not vote_every_s else 7 <= step < 7 + 25, results  # 10 ms steps: a vote every ~20
    assert [step_of(p) for p in complete_checkpoints(root)] == [step]  # one checkpoint, there
    for rank, ((_, why, written, main, saved), received, resumed_from, total) in enumerate(results):
        assert written == f"step-{step:09d}" and saved == [step] and main == (rank == 0)
        assert why == ("SIGINT" if rank == last else "a signal to another rank")
        assert received == (signal.SIGINT if rank == last else 0)
        assert resumed_from == step and total == CFG.epochs * 600 // (CFG.batch_size * world)


def test_the_automatic_interval_scales_with_the_run_and_an_explicit_one_is_obeyed(tmp_path):
    auto = Checkpointer(tmp_path, every_minutes=None)
    assert auto.on and auto.interval_s(20) == AUTO_LEAST_S  # a run of seconds: none before 30 s
    assert auto.interval_s(1200) == 120  # a tenth of a 20-minute run
    assert auto.interval_s(10 * 3600) == AUTO_MOST_S
    assert Checkpointer(tmp_path, every_minutes=2).interval_s(10 * 3600) == 120
    off = Checkpointer(tmp_path, every_minutes=0)
    assert off.interval_s(1200) == 0 and not off.on and not off.overdue(1200)
    assert RecoveryConfig().checkpoint_every_minutes is None and RecoveryConfig().checkpoints()
    assert not RecoveryConfig(checkpoint_every_minutes=0).checkpoints()
    with pytest.raises(ValueError, match="recovery.checkpoint_every_minutes must be >= 0"):
        RecoveryConfig(checkpoint_every_minutes=-1)


def test_one_process_votes_alone_and_its_gap_follows_the_step_time():
    vote = StepVote(10, every_s=1.0)
    assert not vote.due(10) and vote.due(11)  # the first vote after one step
    assert vote.cast(11, DistContext(), late=True, stop=False) == (True, False)
    assert vote.step_seconds > 0 and vote.due(11 + interrupt.MOST_STEPS_BETWEEN_VOTES)


@pytest.mark.slow
def test_the_automatic_interval_writes_checkpoints_by_time_as_the_votes_find_them_due(tmp_path, monkeypatch):
    """One process, the interval's floor lowered to half a second and steps of 20 ms or more:
    checkpoints come by time, half a second apart or more (the vote is what finds them due), the
    first half a second after training starts (not after the setup before it)."""
    import time

    monkeypatch.setattr(interrupt, "VOTE_EVERY_S", 0.05)
    monkeypatch.setattr("flyscale.train.checkpoint.AUTO_LEAST_S", 0.5)
    model = _model()
    model.register_forward_pre_hook(lambda module, _: time.sleep(0.02) if module.training else None)
    ckpt = Checkpointer(tmp_path / "ckpt", every_minutes=None, keep=10)
    started, ended = [], []
    original_save, original_begin = ckpt.save, ckpt.begin

    def begin() -> None:
        original_begin()
        ended.append(time.monotonic())

    def save(*args, **kwargs):
        started.append(time.monotonic())
        out = original_save(*args, **kwargs)
        ended.append(time.monotonic())
        return out

    ckpt.begin, ckpt.save = begin, save  # type: ignore[method-assign]
    time.sleep(0.6)  # setup longer than the interval: it does not count
    cfg = TrainConfig(epochs=2, batch_size=10, lr=1e-2, seed=0)  # 120 steps: at least 2.4 s
    trainer.train(ddp, model, _data(), cfg, DistContext(), DDPOptions(), Hooks(ckpt))
    assert len(started) >= 2 and ckpt.saved[0] > 1, ckpt.saved
    assert all(s - e >= 0.5 for s, e in zip(started, ended)), (started, ended)
