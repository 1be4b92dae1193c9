"""What the benchmarks share: the data, the models measured, interleaved timing, the report."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import statistics
from collections.abc import Callable
from typing import Any

import torch

from flyscale.config import AugmentConfig, DataConfig, ModelConfig
from flyscale.data import source as data
from flyscale.data.augment import augment
from flyscale.data.prepare import prepare_table, prepared_frames
from flyscale.plugin.records import DatasetInfo
from flyscale.train.batches import TrainData, train_data
from flyscale.train.distributed import DistContext

# A tiny step (the default MLP: ~1.5 ms at batch 32) shows fixed per-step overheads at their
# worst; the CNN preset has ten times the compute per step, closer to real models.
MODELS = {
    "mlp (default)": ModelConfig(),
    "cnn (digits-cnn preset)": ModelConfig(name="cnn", options={"channels": [16, 32], "hidden": 128}),
}


def digits_x3() -> tuple[TrainData, object]:
    """Digits' training split with two augmented copies (about 3,500 rows), and its validation split."""
    frame, info = data.load(DataConfig())
    train, val, _ = prepared_frames(prepare_table(frame, DataConfig(), info))
    train = augment(train, info, AugmentConfig(names=["shift", "noise"], copies=2))
    return train_data(train, val, info), info


def synthetic(features: int, rows: int, classes: int = 10, val_rows: int = 512) -> tuple[TrainData, DatasetInfo]:
    """Random features and labels (seed 0): for measuring speed, where what is learnt does not matter."""
    info = DatasetInfo(
        name="synthetic",
        num_classes=classes,
        input_shape=[features],
        feature_columns=[f"f{i}" for i in range(features)],
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, features, generator=g), torch.randint(0, classes, (rows,), generator=g)
    return TrainData(x, y, x[:val_rows], y[:val_rows]), info


def _rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per worker
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out.put(
            (rank, fn(DistContext(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu")), *args))
        )
    finally:
        dist.destroy_process_group()


def on_ranks(fn: Callable[..., Any], *args: Any, world: int = 2) -> list[Any]:
    """`fn(ctx, *args)` on `world` forked single-threaded workers in one gloo group; results in rank order."""
    ctx = mp.get_context("fork")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, value = out.get(timeout=1)
                results[rank] = value
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:  # a crashed worker leaves its peers waiting in a collective
                    raise RuntimeError(f"a benchmark worker exited {failed[0]}; its traceback is above") from None
    finally:
        for p in procs:
            p.join(60 if len(results) == world else 0)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def interleaved(runs: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Every per-epoch time of each run, alternating the runs so that machine drift hits all alike.

    Each round starts one run later than the last (a, b, c; b, c, a; ...): the run that follows
    another can find its caches and allocator as that one left them, and no run should always
    be the one that goes first."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name] += runs[name]()
    return times


def paired_ratios(candidate: list[float], baseline: list[float]) -> list[float]:
    """Each epoch's time over the baseline's epoch of the same round and index (`interleaved`
    lists them in that order), sorted: the two ran within a second of each other, so a slow
    spell of the machine mostly lands on both and cancels."""
    return sorted(c / b for c, b in zip(candidate, baseline))


def report(
    title: str,
    baseline: str,
    candidates: list[str],
    rows: dict[str, dict[str, list[float]]],
    goal: float,
    judge: str = "fastest",
) -> None:
    """One line per model and candidate: the fastest epoch of each and their ratio, and the
    median of the paired ratios with its quartiles; judged against `goal` on the one `judge`
    names ("fastest" or "paired").

    The fastest, as `timeit` takes it: on these shared cores another tenant's work only ever
    adds time to an epoch (medians of one loop swing by 10-20% from run to run here), so the
    fastest of many epochs is the closest measure of what the code itself costs, but it rests
    on two lucky epochs. The paired median rests on all of them; the time noise adds to both
    epochs of a pair dilutes a real difference a little (by the share noise adds to an epoch).
    """
    print(title)
    for model, t in rows.items():
        for candidate in candidates:
            fastest = min(t[candidate]) / min(t[baseline])
            paired = paired_ratios(t[candidate], t[baseline])
            median, q1, q3 = statistics.median(paired), paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
            ratio = median if judge == "paired" else fastest
            verdict = f"(goal <= {goal:.2f} on the {judge}: {'met' if ratio <= goal else 'NOT met'})"
            print(
                f"  {model:<24} {baseline} {min(t[baseline]) * 1000:7.1f} ms/epoch   {candidate} "
                f"{min(t[candidate]) * 1000:7.1f} ms/epoch   fastest's ratio {fastest:.3f}   "
                f"paired ratios' median {median:.3f} (quartiles {q1:.3f}-{q3:.3f}, {len(paired)} pairs) {verdict}"
            )
