"""kill -9 at every filesystem step of a checkpoint's save and commit, then resume: the campaign
tests/test_checkpoint_commit.py checks.

    python -m tests.commit_faults OUT WORLD
    python -m tests.commit_faults full-disk ROOT      (ROOT: a small filesystem of its own)

A tiny training (a 2-layer MLP, AdamW, a batch drawn from the step number, noise from the global
RNG so the RNG state must come back too) runs on WORLD real processes joined by gloo, checkpointing
with the real `Checkpointer` every EVERY steps (keep=1, so a commit also prunes). Each rank
process is forked from this driver, which imported torch once (a fresh interpreter per run would
cost seconds, and there are dozens).

The kill: a rank process installs a CPython audit hook (`sys.addaudithook`, which sees every
`open`, `os.rename`, `os.mkdir`, `os.remove`, `shutil.rmtree` before it runs) and, during the
save of step KILL_STEP, SIGKILLs itself before its n-th filesystem event under the checkpoint
directory: a real kill -9 at a real point of the code, with nothing in the library for it. The
driver then kills the other ranks too (a node going down). A first run with n = 0 only lists
the events; then for every event of every rank: a fresh directory, a run killed there, and a
run that resumes and trains to the end.

Writes OUT/report.json ({"events": {rank: [event, ...]}, "cases": [...]}), OUT/ref/weights.pt
(the run nothing happened to) and OUT/<case>/weights.pt.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from flyscale.train.checkpoint import Checkpointer
from flyscale.train.distributed import process_group
from flyscale.train.state import Position, TrainState
from tests.conftest import free_port

STEPS, EVERY, KILL_STEP = 6, 2, 4
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_DIRECTORY
EVENTS = ("os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree")


def _armed(root: Path, kill_at: int, log: Path):
    """An audit hook counting filesystem events under `root` while `armed[0]`; SIGKILL at `kill_at`."""
    armed: list[bool] = [False]
    seen: list[str] = []
    prefix = str(root)

    def hook(event: str, args: tuple) -> None:
        if not armed[0]:
            return
        if event == "open":
            path, flags = args[0], args[2]
            if not isinstance(path, (str, os.PathLike)) or not (flags & WRITES):
                return
        elif event not in EVENTS:
            return
        elif event in ("os.remove", "os.rmdir") and not (seen and seen[-1].startswith("shutil.rmtree")):
            return  # inside a deletion: only its first removal (a directory half deleted) is a point
        path = os.fspath(args[0]) if isinstance(args[0], (str, os.PathLike)) else ""
        if not path.startswith(prefix) and event != "os.remove":  # rmtree removes by name in a dir fd
            return
        where = path.removeprefix(prefix).lstrip("/") or "."
        if event == "os.rename":
            where += " -> " + os.fspath(args[1]).removeprefix(prefix).lstrip("/")
        seen.append(f"{event} {where}")
        if len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill_at == 0:
            log.write_text("\n".join(seen) + "\n")

    sys.addaudithook(hook)
    return armed


def _rank(out: Path, rank: int, world: int, port: int, kill: tuple[int, int]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    root = out / "ckpt"
    armed = _armed(root, kill[1] if kill[0] == rank else -1, out / f"events-rank{rank}.txt")
    with process_group(timeout_s=30) as ctx:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState(model, opt)
        ckpt = Checkpointer(root, every_steps=EVERY, keep=1)
        found = ckpt.restore(state, ctx, "ddp")
        step = found[0].step if found else 0
        ckpt.restore_rng()
        while step < STEPS:
            step += 1
            data = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 4, generator=data) + 0.1 * torch.randn(8, 4)  # the noise: the global RNG
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if ctx.distributed:
                for p in model.parameters():
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            opt.step()
            if ckpt.due(step):
                armed[0] = step == KILL_STEP
                ckpt.save(state, Position(step=step), ctx, "ddp")
                armed[0] = False
        ckpt.wait()
        if ctx.is_main:
            torch.save(model.state_dict(), out / "weights.pt")
            (out / "resumed.txt").write_text(
                str(found[1].source if found else "") + f"\n{found[0].step if found else 0}"
            )


def run(out: Path, world: int, kill: tuple[int, int] = (-1, -1)) -> int:
    """Fork `world` ranks training under `out`; 0 when all finished, -9 when one was killed (the
    others are then killed too), 1 when one failed."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _rank(out, rank, world, port, kill)
                code = 0
            except BaseException:  # noqa: BLE001 (its traceback, then its exit code)
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    result, left = 0, set(pids)
    while left:
        pid, status = os.waitpid(-1, 0)
        left.discard(pid)
        failed = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else min(os.WEXITSTATUS(status), 1)
        if failed and not result:
            result = failed
            for other in left:
                os.kill(other, signal.SIGKILL)
    return result


def campaign(out: Path, world: int, start: Path | None, report: dict) -> None:
    """Every kill point of every rank in the save of KILL_STEP, each from a copy of the checkpoint
    directory `start` (None: empty), then a resume to the end; into `report`."""

    def fresh(case: Path) -> Path:
        shutil.rmtree(case, ignore_errors=True)
        if start is not None:
            shutil.copytree(start, case / "ckpt")
        return case

    for rank in range(world):
        listing = fresh(out / f"events-rank{rank}")
        assert run(listing, world, (rank, 0)) == 0
        events = (listing / f"events-rank{rank}.txt").read_text().splitlines()
        report["events"][f"{out.name} rank {rank}"] = events
        for n, event in enumerate(events, start=1):
            case = fresh(out / f"rank{rank}-{n:02d}")
            killed = run(case, world, (rank, n))
            left = sorted(p.name for p in (case / "ckpt").iterdir())
            resumed = run(case, world)
            source, step = (case / "resumed.txt").read_text().split("\n") if resumed == 0 else ("", "-1")
            report["cases"].append(
                {
                    "campaign": out.name,
                    "rank": rank,
                    "at": n,
                    "event": event,
                    "killed": killed,
                    "left": left,
                    "resumed": resumed,
                    "source": source,
                    "step": int(step),
                    "weights": str(case / "weights.pt"),
                }
            )


def main(out: Path, world: int) -> None:
    """The run nothing happened to; every kill point of a save of a new step; and of a save that
    replaces a damaged step of the same number (a resume fell back from it, and redid it)."""
    torch.set_num_threads(1)
    report: dict = {"events": {}, "cases": []}
    _rank(out / "warm", 0, 1, 0, (-1, -1))  # here, once: what a save and a restore import, every fork has
    assert run(out / "ref", world) == 0
    campaign(out / "new", world, None, report)
    # Killed once step 4 was committed (step 2 still there), then step 4 damaged on disk.
    renamed = [c for c in report["cases"] if c["event"] == "os.rename step-000000004.partial -> step-000000004"]
    base = out / "new" / f"rank0-{renamed[0]['at'] + 1:02d}-base"
    assert run(base, world, (0, renamed[0]["at"] + 1)) == -signal.SIGKILL
    torn = base / "ckpt" / "step-000000004" / "rank-0.pt"
    torn.write_bytes(torn.read_bytes()[:-1] + bytes([torn.read_bytes()[-1] ^ 0xFF]))
    campaign(out / "replace", world, base / "ckpt", report)
    (out / "report.json").write_text(json.dumps(report, indent=1))


def full_disk(root: Path) -> None:
    """On `root`, a small filesystem of its own (a tmpfs): a checkpoint, then the disk filled but
    for a few KiB, then a save (synchronous, then asynchronous) that meets ENOSPC. Prints as JSON
    what each raised, whether the first checkpoint still verifies, what is left, what a restore finds."""
    from flyscale.train.checkpoint_files import verify_files
    from flyscale.train.distributed import DistContext

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    state, ctx, found = TrainState(model, opt), DistContext(), {}
    for mode in ("sync", "async"):
        ckpt = Checkpointer(root / mode, every_steps=1, keep=2, asynchronous=mode == "async")
        first = ckpt.save(state, Position(step=1), ctx, "ddp")
        ckpt.wait()
        filler = root / f"filler-{mode}"
        with open(filler, "wb") as f:  # all but 8 KiB: the next checkpoint (~120 KiB) cannot fit
            f.write(b"\0" * (shutil.disk_usage(root).free - 8192))
        try:
            ckpt.save(state, Position(step=2), ctx, "ddp")
            ckpt.wait()
            error = ""
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        intact = verify_files(first)["step"] == 1
        left = sorted(p.name for p in (root / mode).iterdir())
        filler.unlink()
        restored = Checkpointer(root / mode).restore(state, ctx, "ddp")
        found[mode] = {"error": error, "intact": intact, "left": left, "restored": restored[0].step if restored else 0}
    print(json.dumps(found))


if __name__ == "__main__":
    if sys.argv[1] == "full-disk":
        full_disk(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), int(sys.argv[2]))
