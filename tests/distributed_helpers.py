"""Run a function on N real processes joined by gloo, as torch-elastic would start them.

The ranks are forked from a forkserver: one clean process per test worker that imported torch and
flyscale's training modules once. A spawned rank imports them itself, seconds of CPU for every
process of every call, and the suite is CPU-bound on its two cores. Each rank still
starts as a spawned one would: its own process, the caller's environment, no state of the test's.
"""

from __future__ import annotations

import os
import pickle
import traceback

import torch.multiprocessing as mp

from tests.conftest import free_port

# What every rank imports: the forkserver imports it once, before it forks any rank.
PRELOAD = [
    "torch",
    "torch.distributed",
    "flyscale.train.trainer",
    "flyscale.train.strategies",
    "tests.distributed_helpers",
]


def context():
    """The multiprocessing context that starts ranks (see the module's docstring)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def as_caller(environ: dict[str, str]) -> None:
    """Give a forked rank the environment of the call (`dict(os.environ)` there), as a spawned
    process would have it: the forkserver's is its own, from when it started. (The working
    directory and sys.path multiprocessing hands over itself.)"""
    os.environ.clear()
    os.environ.update(environ)


def _entry(rank: int, world: int, port: int, fn, args, results, environ):
    as_caller(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    try:
        # Pickled here: the manager would otherwise unpickle every rank's result in threads of its
        # own, importing torch and flyscale from several at once (an import deadlock under load).
        results[rank] = ("ok", pickle.dumps(fn(*args)))
    except BaseException:  # report the worker's own traceback, not a bare exit code
        results[rank] = ("error", traceback.format_exc())
        raise


def run_on_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """fn(*args) on `world` processes; returns each rank's result, in rank order."""
    ctx = context()
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, fn, args, results, dict(os.environ))) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout}s")
        out = []
        for r in range(world):
            status, value = results.get(r, ("error", f"rank {r} exited with code {procs[r].exitcode}"))
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            out.append(pickle.loads(value))
        return out
