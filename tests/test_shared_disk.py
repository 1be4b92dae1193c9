"""A multi-node run's checkpoint directory, on two real gloo ranks that stand for two nodes: each
rank its own base directory ("its node's disk") or one base for both (a shared volume). Separate
disks are refused on every rank before training, naming what to mount; a shared one checkpoints
and resumes; a checkpoint one rank cannot see fails on every rank, naming that rank; and every
rank leaves each step in step with the others (no rank is left alone in a collective)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch

from tests.distributed_helpers import run_on_ranks


def _state():
    torch.manual_seed(0)  # the same weights on every rank, as DDP's replicas
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    from flyscale.train.state import TrainState

    return TrainState(model, opt)


def _claim(tmp: str) -> dict:
    from flyscale.train.distributed import process_group
    from flyscale.train.run_dirs import restart_directory
    from flyscale.train.shared_disk import CheckpointDirNotShared

    out: dict = {}
    Path(tmp, "a-file").touch()
    with process_group(timeout_s=20) as ctx:
        for layout, base in (
            ("apart", f"{tmp}/node{ctx.rank}"),
            ("shared", f"{tmp}/volume"),
            ("rank 0 cannot claim", f"{tmp}/a-file" if ctx.is_main else f"{tmp}/volume"),
        ):
            try:
                with restart_directory(ctx, base, "k", "owner") as root:
                    out[layout] = ("trains in", str(root), sorted(p.name for p in root.iterdir()))
            except CheckpointDirNotShared as exc:
                out[layout] = ("refused", str(exc))
            except OSError as exc:
                out[layout] = (type(exc).__name__, exc.filename)
            # Every rank left the step together: a rank that went on alone would meet the others'
            # collective of the step before, and hang or read garbage here.
            out[f"{layout}: in step after"] = ctx.all_gather_object(ctx.rank)
    return out


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_ranks_on_separate_disks_are_refused_together_before_training_naming_what_to_mount(tmp_path):
    rank0, rank1 = run_on_ranks(_claim, 2, str(tmp_path), timeout=120)
    for rank in (rank0, rank1):
        assert rank["apart: in step after"] == rank["shared: in step after"] == [0, 1], rank
        assert rank["rank 0 cannot claim: in step after"] == [0, 1], rank
    # Rank 0's claim failed (its base is a file): rank 1 stops with rank 0's own error.
    assert (
        rank0["rank 0 cannot claim"]
        == rank1["rank 0 cannot claim"]
        == ("NotADirectoryError", f"{tmp_path}/a-file/run-k")
    )
    # Separate disks: both ranks refuse, with one message saying who could not see what, and what to do.
    assert rank0["apart"][0] == rank1["apart"][0] == "refused", (rank0, rank1)
    message = rank0["apart"][1]
    assert rank1["apart"][1] == message
    for needed in (
        "recovery.checkpoint_dir is not shared by every node",
        "rank 1 (host ",
        f"at {tmp_path}/node1/run-k/.shared-probe-",
        f"rank 0 (host {socket.gethostname()}) wrote in {tmp_path}/node0/run-k",
        "no such file there",
        "Mount a ReadWriteMany volume",
        f"(now '{tmp_path}/node0')",
        "FLYSCALE_NNODES=1",
        "recovery.checkpoint_every_minutes: 0",
    ):
        assert needed in message, (needed, message)
    assert [p.name for p in (tmp_path / "node0" / "run-k").iterdir()] == [".lock"]  # the probe is gone
    # One volume: both train in the directory rank 0 claimed, and the probe is gone.
    assert rank0["shared"] == rank1["shared"] == ("trains in", f"{tmp_path}/volume/run-k", [".lock"])


def _checkpoints(tmp: str) -> dict:
    from flyscale.train.checkpoint import Checkpointer
    from flyscale.train.checkpoint_files import CheckpointError
    from flyscale.train.distributed import process_group
    from flyscale.train.state import Position

    out: dict = {}
    with process_group(timeout_s=20) as ctx:
        # One volume: both ranks write their files into one checkpoint, and both resume from it.
        volume = Path(tmp, "volume", "run-k")
        Checkpointer(volume, every_steps=1).save(_state(), Position(step=5, epoch=1, batch=2), ctx, "ddp")
        fresh = _state()
        with torch.no_grad():
            for p in fresh.module.parameters():
                p.zero_()
        position, resumed = Checkpointer(volume).restore(fresh, ctx, "ddp")
        out["resumed"] = (position.step, position.batch, resumed.source, resumed.path)
        out["same weights"] = all(
            torch.equal(a, b) for a, b in zip(fresh.module.state_dict().values(), _state().module.state_dict().values())
        )
        out["files"] = sorted(p.name for p in (volume / "step-000000005").iterdir())
        # That checkpoint on rank 0's disk only: every rank refuses, naming the rank that cannot see it.
        mine = Path(tmp, f"node{ctx.rank}", "run-k")
        if ctx.is_main:
            shutil.copytree(volume, mine)
        ctx.barrier()
        try:
            Checkpointer(mine).restore(_state(), ctx, "ddp")
            out["unseen"] = "resumed"
        except CheckpointError as exc:
            out["unseen"] = str(exc)
        out["in step after"] = ctx.all_gather_object(ctx.rank)  # hangs if a rank went on into DCP's load alone
        # Separate disks (no probe): each rank makes the directory it writes its own files in.
        apart = Path(tmp, f"node{ctx.rank}", "run-s")
        Checkpointer(apart, every_steps=1).save(_state(), Position(step=1), ctx, "ddp")
        out["wrote"] = sorted(str(p.relative_to(apart)) for p in apart.rglob("rank-*.pt"))
    return out


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_shared_volume_checkpoints_and_resumes_and_a_checkpoint_one_rank_cannot_see_fails_on_every_rank(tmp_path):
    rank0, rank1 = run_on_ranks(_checkpoints, 2, str(tmp_path), timeout=120)
    step = f"{tmp_path}/volume/run-k/step-000000005"
    assert rank0["resumed"] == rank1["resumed"] == (5, 2, "local", step)
    assert rank0["same weights"] and rank1["same weights"]
    assert rank0["files"] == ["manifest.json", "rank-0.pt", "rank-1.pt", "state"]
    assert rank0["in step after"] == rank1["in step after"] == [0, 1]
    unseen = rank0["unseen"]
    assert rank1["unseen"] == unseen
    assert unseen.startswith(f"rank 1 (host {socket.gethostname()}) cannot see manifest.json of "), unseen
    assert f"{tmp_path}/node1/run-k/step-000000005" in unseen and "ReadWriteMany" in unseen, unseen
    # Rank 0 committed its step; rank 1 wrote its file in a directory of its own making.
    assert rank0["wrote"] == ["step-000000001/rank-0.pt"]
    assert rank1["wrote"] == ["step-000000001.partial/rank-1.pt"]
