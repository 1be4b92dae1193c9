"""Surviving dead workers: real worker processes under torch-elastic's launcher, real gloo, real
SIGKILL and SIGSTOP. A killed worker is restarted and the group resumes from its last checkpoint
with the weights an uninterrupted run ends with; a retried attempt resumes from what the previous
attempt saved through Flyte's checkpoint API; a stopped worker becomes an error naming it;
damaged or foreign checkpoints are refused before anything is loaded."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flyscale.train.checkpoint import Checkpointer
from flyscale.train.checkpoint_files import MANIFEST, CheckpointError, NoIntactCheckpoint, complete_checkpoints
from flyscale.train.distributed import DistContext
from flyscale.train.run_dirs import claimed_directory, is_held, run_directory
from flyscale.train.state import Position, TrainState
from tests.conftest import REPO

EVERY = 20  # steps between checkpoints
EPOCHS = 4  # 47 steps an epoch for ddp on 2 workers (batch 16 each), 93 for the pipeline (batch 16)


def _launch(
    out: Path, strategy: str, restarts: int, *flyte: str, env: dict | None = None, epochs: int = EPOCHS
) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "w")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.recovery_helpers",
            str(out),
            strategy,
            "2",
            str(restarts),
            str(EVERY),
            str(epochs),
            *flyte,
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group
        env={**os.environ, **(env or {})},
    )


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 240) -> dict:
    assert proc.wait(timeout) == 0, (out / "log.txt").read_text()[-5000:]
    return json.loads((out / "history.json").read_text())


def _wait_for(predicate, proc: subprocess.Popen, out: Path, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, (
            f"the run ended before the fault was injected:\n{(out / 'log.txt').read_text()[-3000:]}"
        )
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting; log:\n{(out / 'log.txt').read_text()[-3000:]}")


def _newest_step(root: Path) -> int:
    done = [int(p.name.split("-")[1]) for p in complete_checkpoints(root)]
    return max(done, default=0)


def _whole_json(path: Path) -> bool:
    """Whether `path` holds whole JSON now: not half-written, and not pruned (the mirror drops the
    uploads older than its newest few, so a manifest a glob just listed may be gone when read)."""
    try:
        json.loads(path.read_text())
    except (ValueError, FileNotFoundError):
        return False
    return True


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per strategy: the run nothing happened to (same seed, same checkpoint interval)."""
    runs = {}

    def get(strategy: str) -> tuple[Path, dict]:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{strategy}")
            runs[strategy] = (out, _finish(_launch(out, strategy, 0), out))
        return runs[strategy]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "pipeline", "fsdp"])
@pytest.mark.slow
def test_a_killed_worker_then_a_preempted_attempt_both_resume_exactly(tmp_path, strategy, uninterrupted):
    """Both kinds of restart in one run, as a spot node sees them: a worker dies and torch-elastic
    restarts the group (from the local directory); then the whole attempt is preempted and Flyte
    retries it on another node (from what the attempt uploaded through Flyte's checkpoint API).
    The run ends with the weights of a run nothing happened to."""
    ref_out, ref = uninterrupted(strategy)
    first, second = tmp_path / "attempt-1", tmp_path / "attempt-2"
    first_dest, second_dest = tmp_path / "flyte" / "attempt-1", tmp_path / "flyte" / "attempt-2"
    proc = _launch(first, strategy, 1, str(first_dest))

    # 1. SIGKILL to rank 1 mid-run (a few checkpoints in, and mid-epoch: no epoch ends on a
    # multiple of 20 steps here). torch-elastic restarts the group, which resumes from the newest
    # checkpoint (or the one its peer was finishing): no checkpoint completes without the dead
    # rank, so the killed group got less than one interval past it, and that is all the work
    # done twice.
    seen = _wait_for(lambda: _newest_step(first / "ckpt") >= 3 * EVERY and _newest_step(first / "ckpt"), proc, first)
    os.kill(int((first / "pids" / "rank1-restart0").read_text()), signal.SIGKILL)
    _wait_for(lambda: "resuming from checkpoint" in (first / "log.txt").read_text(), proc, first)
    resumed = int(
        re.search(r"resuming from checkpoint \S+ \(local\): step (\d+)", (first / "log.txt").read_text()).group(1)
    )
    assert (first / "pids" / "rank1-restart1").exists(), "torch-elastic did not restart the worker group"
    assert resumed in (seen, seen + EVERY), (seen, resumed)

    # 2. The restarted group uploads further checkpoints; then every process of the attempt dies
    # at once (the pod is preempted).
    # A manifest is the last file of an upload, but a local store copies it in place: the kill
    # can leave one half-written, which the retry must pass over (loudly) for the step before.
    def manifests() -> dict[int, bool]:
        return {int(p.parent.name.split("-")[1]): _whole_json(p) for p in first_dest.glob(f"step-*/{MANIFEST}")}

    def uploaded() -> int:
        return max((step for step, whole in manifests().items() if whole), default=0)

    _wait_for(lambda: uploaded() >= resumed + 2 * EVERY, proc, first)
    with contextlib.suppress(ProcessLookupError):  # on a slow machine it may have finished: still a valid source
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    saved = uploaded()
    torn = sorted((step for step, whole in manifests().items() if not whole and step > saved), reverse=True)

    # 3. The retry runs on another node: a fresh local restart directory, and the previous
    # attempt's checkpoint as its source, as Flyte hands them to the next attempt.
    history = _finish(_launch(second, strategy, 0, str(second_dest), str(first_dest)), second)
    source = f"mirror; fell back from damaged {', '.join(f'step {t}' for t in torn)}" if torn else "mirror"
    assert history["resumed_from_step"] == saved and f"({source})" in history["resumed_from"], history
    assert history["steps"] == ref["steps"] and history["steps_run"] == ref["steps"] - saved
    _same_weights(second / "weights.pt", ref_out / "weights.pt")
    assert history["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-6)  # the resumed epochs' metrics too
    # This attempt uploads its own checkpoints for the next one, keeping the newest two.
    assert 1 <= len(list(second_dest.glob(f"step-*/{MANIFEST}"))) <= 2


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_a_second_run_of_one_training_keeps_its_checkpoints_apart(tmp_path, uninterrupted):
    """Two runs of the same training at once (one key: config, data, launcher), under one base:
    the first holds the training's directory while it trains, the second takes its own. Each is
    killed and resumes from its own checkpoints, never from those the other is writing.

    The first trains for long (it is the holder; the key here is the seed alone), so a resume of
    the second from the first's checkpoints would end elsewhere than the run nothing happened to."""
    ref_out, _ = uninterrupted("ddp")
    base = tmp_path / "shared"
    shared = run_directory(str(base), "seed3")
    env = lambda owner: {"FLYSCALE_TEST_CKPT_BASE": str(base), "FLYSCALE_TEST_OWNER": owner}  # noqa: E731
    first, second = tmp_path / "first", tmp_path / "second"
    holder = _launch(first, "ddp", 1, env={**env("first"), "FLYSCALE_TEST_EPOCH_PAUSE_S": "1"}, epochs=400)
    try:
        _wait_for(lambda: is_held(shared), holder, first)
        proc = _launch(second, "ddp", 1, env=env("second"))
        _wait_for(lambda: len(list(base.iterdir())) == 2, proc, second)
        (own,) = set(base.iterdir()) - {shared}
        _wait_for(lambda: _newest_step(own) >= 2 * EVERY, proc, second)
        os.kill(int((second / "pids" / "rank1-restart0").read_text()), signal.SIGKILL)
        history = _finish(proc, second)
        assert "another run of the same training" in (second / "log.txt").read_text()
        assert history["resumed_from_step"] >= 2 * EVERY and history["resumed_from"].startswith(str(own)), history
        assert history["steps_run"] < history["steps"]  # it resumed rather than started over
        _same_weights(second / "weights.pt", ref_out / "weights.pt")
        # The holder, killed in its turn, goes back to the training's directory, not the other's.
        os.kill(int((first / "pids" / "rank1-restart0").read_text()), signal.SIGKILL)
        _wait_for(lambda: "resuming from checkpoint" in (first / "log.txt").read_text(), holder, first)
        assert re.search(rf"resuming from checkpoint {re.escape(str(shared))}/step-", (first / "log.txt").read_text())
        assert sorted(base.iterdir()) == sorted([shared, own])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(30)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_stopped_worker_fails_the_run_naming_it_instead_of_hanging(tmp_path):
    proc = _launch(tmp_path, "ddp", 0, env={"FLYSCALE_TEST_TIMEOUT_S": "5"})
    _wait_for(lambda: _newest_step(tmp_path / "ckpt") >= EVERY, proc, tmp_path)
    victim = int((tmp_path / "pids" / "rank1-restart0").read_text())
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _wait_for(lambda: "lost its peers" in (tmp_path / "log.txt").read_text(), proc, tmp_path, timeout=60)
        noticed = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)  # let the launcher's SIGTERM reach it
    assert proc.wait(120) != 0
    log = (tmp_path / "log.txt").read_text()
    assert "Lost rank(s): 1." in log, log[-4000:]
    assert noticed < 5 + 3 + 20, noticed  # the timeout, the store's grace, and a loaded machine's slack


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_retryable_and_a_bug_is_not():
    """Through flytekit's own Elastic task: torch-elastic's ChildFailedError, wrapped by flytekit
    as a non-retryable user error, is turned into a FlyteRecoverableException only for a signal."""
    from flytekit import task
    from flytekit.exceptions.user import FlyteRecoverableException

    from flyscale.cluster.launchers import LocalSafeElastic

    @task(task_config=LocalSafeElastic(nnodes=1, nproc_per_node=2, max_restarts=0, monitor_interval=0.1))
    def fails(how: str) -> int:
        import os
        import signal

        if os.environ["RANK"] == "1":
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("a bug in the training code")
        return 0

    with pytest.raises(FlyteRecoverableException, match=r"training workers were killed: rank 1 \(pid \d+\) by SIGKILL"):
        fails(how="killed")
    with pytest.raises(Exception, match="a bug in the training code") as bug:
        fails(how="bug")
    assert not isinstance(bug.value, FlyteRecoverableException)


# -- checkpoints on one process: damage and incompatibility are refused before loading ----------


def _state(hidden: int = 8) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return TrainState(model, opt)


def _saved(tmp_path: Path, steps: list[int]) -> Checkpointer:
    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=1, keep=5)
    for step in steps:
        ckpt.save(_state(), Position(step=step, epoch=0, batch=step), DistContext(), "ddp")
    return ckpt


def test_a_truncated_checkpoint_that_resume_from_names_is_refused_naming_it(tmp_path):
    """The user's choice is not passed over (a damaged newest of the run's own is:
    tests/test_checkpoint_commit.py)."""
    ckpt = _saved(tmp_path, [1, 2])
    newest = complete_checkpoints(ckpt.root)[-1]
    part = newest / "state" / "__0_0.distcp"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    named = Checkpointer(tmp_path / "mine", resume_from=str(newest))
    with pytest.raises(
        CheckpointError, match=rf"{newest}.*state/__0_0.distcp is \d+ bytes, the manifest says \d+ \(truncated"
    ):
        named.restore(_state(), DistContext(), "ddp")


def test_a_corrupt_or_unfinished_checkpoint_is_refused(tmp_path):
    ckpt = _saved(tmp_path, [1])
    newest = complete_checkpoints(ckpt.root)[-1]
    data = bytearray((newest / "rank-0.pt").read_bytes())
    data[-10] ^= 0xFF  # same size, one flipped byte
    (newest / "rank-0.pt").write_bytes(bytes(data))
    with pytest.raises(NoIntactCheckpoint, match=r"rank-0.pt does not match its sha256 in the manifest \(corrupt\)"):
        ckpt.restore(_state(), DistContext(), "ddp")
    (newest / MANIFEST).unlink()
    with pytest.raises(NoIntactCheckpoint, match=rf"{newest} has no manifest.json"):
        ckpt.restore(_state(), DistContext(), "ddp")


def test_a_checkpoint_of_another_model_or_strategy_is_refused(tmp_path):
    ckpt = _saved(tmp_path, [3])
    with pytest.raises(
        CheckpointError,
        match=r"holds another model than this run builds: 0.bias is float32 \[8\] in the checkpoint and "
        r"float32 \[16\] in this model",
    ):
        ckpt.restore(_state(hidden=16), DistContext(), "ddp")
    with pytest.raises(CheckpointError, match=r"written by strategy 'ddp', this run uses 'pipeline'"):
        ckpt.restore(_state(), DistContext(), "pipeline")


def test_a_good_checkpoint_restores_the_state_and_position(tmp_path):
    ckpt = _saved(tmp_path, [1, 2, 3])
    assert [p.name for p in complete_checkpoints(ckpt.root)] == ["step-000000001", "step-000000002", "step-000000003"]
    fresh = _state(hidden=8)
    with torch.no_grad():
        for p in fresh.module.parameters():
            p.zero_()
    position, resumed = ckpt.restore(fresh, DistContext(), "ddp")
    assert (position.step, position.batch, resumed.source) == (3, 3, "local")
    for a, b in zip(fresh.module.state_dict().values(), _state().module.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1


def test_only_the_newest_checkpoints_are_kept_and_resume_can_be_turned_off(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=1, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(_state(), Position(step=step), DistContext(), "ddp")
    assert [p.name for p in complete_checkpoints(ckpt.root)] == ["step-000000003", "step-000000004"]
    off = Checkpointer(tmp_path / "ckpt", resume=False)
    assert off.restore(_state(), DistContext(), "ddp") is None


def test_a_run_directory_is_found_by_its_training_and_held_while_it_trains(tmp_path, caplog):
    """The same training again (after a crash: its lock is gone) finds the directory and its
    checkpoints; the same training while another run holds it gets a directory of its own, and
    goes back to that one after a restart; another training, another directory."""
    base = str(tmp_path)
    with claimed_directory(base, "k1", "first") as first:
        Checkpointer(first, every_steps=1).save(_state(), Position(step=7), DistContext(), "ddp")
        assert is_held(first)
        with claimed_directory(base, "k1", "second") as second:
            assert second != first and second.name.startswith(first.name + "-")
            Checkpointer(second, every_steps=1).save(_state(), Position(step=9), DistContext(), "ddp")
            assert Checkpointer(second).restore(_state(), DistContext(), "ddp")[0].step == 9
        assert "another run of the same training" in caplog.text and "first (pid" in caplog.text
        with claimed_directory(base, "k2", "first") as other:
            assert other not in (first, second) and Checkpointer(other).restore(_state(), DistContext(), "ddp") is None
    assert not is_held(first)
    with claimed_directory(base, "k1", "third") as again:  # the rerun after a Ctrl-C
        assert again == first and Checkpointer(again).restore(_state(), DistContext(), "ddp")[0].step == 7
        with claimed_directory(base, "k1", "second") as restarted:  # "second" restarts: back to its own
            assert restarted == second
    with claimed_directory(base, "k1", "second") as restarted:  # even with the shared one free
        assert restarted == second


def test_the_training_key_changes_with_what_is_trained():
    from flyscale.config import AugmentConfig, ModelConfig, ObjectiveConfig, TrainConfig
    from flyscale.data.source import DataFingerprint
    from tasks.train import identity

    data, model, train, aug = DataFingerprint("digits", "abc", "stat"), ModelConfig(), TrainConfig(), AugmentConfig()
    goal = ObjectiveConfig()
    key = identity(data, model, train, 2, aug, goal)
    assert key == identity(
        DataFingerprint("digits", "abc", "stat"), ModelConfig(), TrainConfig(), 2, AugmentConfig(), ObjectiveConfig()
    )
    others = [
        identity(DataFingerprint("digits", "abd", "stat"), model, train, 2, aug, goal),
        identity(data, ModelConfig(name="cnn"), train, 2, aug, goal),
        identity(data, model, TrainConfig(seed=train.seed + 1), 2, aug, goal),
        identity(data, model, train, 2, AugmentConfig(names=["shift"]), goal),  # typed examples: augmented as drawn
        identity(data, model, train, 2, aug, ObjectiveConfig("regression")),  # another loss, another model
    ]
    assert key not in others and len(set(others)) == 5
    # Not the worker count: every built-in strategy's checkpoints reshard, so the same training
    # run again on 3 workers finds the directory 2 workers left.
    assert identity(data, model, train, 3, aug, goal) == key


def test_resume_from_names_a_checkpoint_explicitly(tmp_path):
    """recovery.resume_from: a step directory, or a run directory (its newest), of another run."""
    other = _saved(tmp_path, [1, 2, 3])
    named = Checkpointer(tmp_path / "mine", resume_from=str(other.root))
    position, resumed = named.restore(_state(), DistContext(), "ddp")
    assert (position.step, resumed.source) == (3, "recovery.resume_from")
    step2 = complete_checkpoints(other.root)[1]
    position, resumed = Checkpointer(tmp_path / "mine", resume_from=str(step2)).restore(_state(), DistContext(), "ddp")
    assert position.step == 2 and resumed.path == str(step2)
    # Once this run has gone further (a worker restart after the resume), its own newer one wins.
    mine = Checkpointer(tmp_path / "mine", every_steps=1, resume_from=str(step2))
    mine.save(_state(), Position(step=5), DistContext(), "ddp")
    assert mine.restore(_state(), DistContext(), "ddp")[0].step == 5
    with pytest.raises(CheckpointError, match=rf"recovery.resume_from '{tmp_path / 'nowhere'}' is no checkpoint"):
        Checkpointer(tmp_path / "x", resume_from=str(tmp_path / "nowhere")).restore(_state(), DistContext(), "ddp")


@pytest.mark.slow
def test_flyscale_checkpoints_lists_the_runs_left_behind_and_prunes_the_old_ones(tmp_path):
    base = tmp_path / "base"
    old, recent = run_directory(str(base), "a"), run_directory(str(base), "b")
    with claimed_directory(str(base), "c", "a live run") as busy:
        for root, steps in ((old, [4]), (recent, [1, 2]), (busy, [3])):
            ckpt = Checkpointer(root, every_steps=1, keep=5)
            for step in steps:
                ckpt.save(_state(), Position(step=step), DistContext(), "ddp")
        week_ago = time.time() - 8 * 86400
        for f in [*old.rglob("*"), *busy.rglob("*")]:
            os.utime(f, (week_ago, week_ago))
        flyscale = [str(Path(sys.executable).parent / "flyscale"), "checkpoints", "--dir", str(base)]
        listed = subprocess.run(flyscale, capture_output=True, text=True, check=True).stdout
        assert f"{old}  steps 4..4" in listed and f"{recent}  steps 1..2" in listed
        assert re.search(rf"{re.escape(str(busy))}  steps 3..3 .* ago  \(in use: a run is training in it\)", listed)
        assert listed.count("in use") == 1
        pruned = subprocess.run([*flyscale, "--prune-days", "7"], capture_output=True, text=True, check=True).stdout
        assert f"deleted 1 run folder(s) not written for 7 day(s)\n  {old}" in pruned
        assert not old.exists() and recent.exists() and busy.exists()  # a held one is never pruned
