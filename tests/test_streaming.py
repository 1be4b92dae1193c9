"""The streaming loader: row groups of Parquet shards, sharded across (rank, DataLoader worker),
the same number of batches on every rank, seeded shuffles; and DDP training through it on real
gloo processes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from flyscale.config import TrainConfig
from flyscale.data import shards
from flyscale.data.fields import Reader
from flyscale.data.streaming import Stream, StreamingShards
from flyscale.train import trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext, set_epoch
from tests.distributed_helpers import run_on_ranks

FEATURES = Reader("label", ("a", "b"))


def _split(tmp_path, rows: int = 1000, row_group_rows: int = 64) -> list[shards.Unit]:
    """Rows whose feature `a` is their id (so a batch says which rows it holds), in small row groups."""
    frame = pd.DataFrame(
        {"a": np.arange(rows, dtype="float32"), "b": np.zeros(rows, "float32"), "label": np.arange(rows) % 3}
    )
    writer = shards.ShardWriter("test", rows_per_file=300, row_group_rows=row_group_rows)
    writer.root = tmp_path
    for start in range(0, rows, 97):  # arriving in odd-sized pieces
        writer.write(frame.iloc[start : start + 97])
    writer.close()
    return shards.units(str(tmp_path))


def _epoch(units, rank, world, workers, epoch=0, batch=16, seed=3) -> list[np.ndarray]:
    stream = StreamingShards(
        units, FEATURES, batch, rank=rank, world=world, workers=workers, seed=seed, buffer_rows=100
    )
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    set_epoch(loader, epoch)
    got = [xb[:, 0].numpy().astype(int) for xb, _ in loader]
    assert len(got) == len(loader)
    return got


def test_row_groups_come_from_the_footers_in_order(tmp_path):
    units = _split(tmp_path)
    assert sum(u.rows for u in units) == 1000 and max(u.rows for u in units) <= 64
    assert [u.file for u in units] == sorted(u.file for u in units) and len({u.file for u in units}) == 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_gets_the_same_number_of_full_batches_of_distinct_rows(tmp_path, workers):
    units = _split(tmp_path)
    ranks = [_epoch(units, r, 3, workers) for r in range(3)]
    counts = {len(r) for r in ranks}
    assert len(counts) == 1  # nothing waits in a collective for a rank that ran out
    seen = np.concatenate([b for r in ranks for b in r])
    assert all(len(b) == 16 for r in ranks for b in r)
    assert len(seen) == len(set(seen.tolist()))  # each row at most once per epoch
    assert len(seen) >= 1000 - 3 * max(workers, 1) * 64 - 3 * 16  # only tails are left out


@pytest.mark.timeout(120)
def test_shuffles_are_seeded_per_epoch_and_reach_across_row_groups(tmp_path):
    units = _split(tmp_path)
    first = _epoch(units, 0, 2, 2, epoch=0)
    assert [b.tolist() for b in first] == [b.tolist() for b in _epoch(units, 0, 2, 2, epoch=0)]  # seeded
    assert [b.tolist() for b in first] != [b.tolist() for b in _epoch(units, 0, 2, 2, epoch=1)]  # per epoch
    groups = [len(set((b // 64).tolist())) for b in first]  # a row group holds 64 consecutive ids
    assert max(groups) > 1  # the buffer mixes rows of several row groups into one batch


@pytest.mark.timeout(120)
def test_persistent_workers_still_reshuffle_each_epoch(tmp_path):
    units = _split(tmp_path)
    stream = StreamingShards(units, FEATURES, 16, rank=0, world=1, workers=2, seed=3, buffer_rows=100)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        set_epoch(loader, epoch)  # the workers' copies never see this; they count their passes
        epochs.append([xb[:, 0].tolist() for xb, _ in loader])
    assert epochs[0] != epochs[1]
    assert epochs[1] == [b.tolist() for b in _epoch(units, 0, 1, 2, epoch=1)]  # the same as a fresh epoch 1


def _train_streamed(root: str) -> dict:
    from flyscale.train.distributed import process_group
    from flyscale_plugins.strategies.ddp import DDPOptions, ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    units = shards.units(root)
    data = TrainData(
        torch.zeros(0, 2),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 2),
        torch.zeros(0, dtype=torch.long),
        stream=Stream(units, units, FEATURES, buffer_rows=128),
    )
    cfg = TrainConfig(epochs=3, batch_size=32, lr=0.01, num_workers=2)
    with process_group(timeout_s=60) as ctx:
        history = trainer.train(ddp, model, data, cfg, ctx, DDPOptions()).history
    return {"val_accuracy": history.epochs[-1].val_accuracy, "samples": [m.samples_per_s > 0 for m in history.epochs]}


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_ddp_trains_on_streamed_shards_across_real_processes(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 2)).astype("float32")
    label = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)  # 0, 1 or 2: learnable
    writer = shards.ShardWriter("ddp", rows_per_file=1000, row_group_rows=250)
    writer.write(pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "label": label}))
    split = writer.close()
    results = run_on_ranks(_train_streamed, 2, split.dir.path, timeout=200)
    assert results[0] == results[1]  # metrics are reduced over ranks: both see the same numbers
    assert results[0]["val_accuracy"] > 0.9 and all(results[0]["samples"])


def test_an_in_memory_split_is_one_shard_read_back_whole(tmp_path):
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0], "label": [0, 1, 0]})
    split = shards.write(frame, "val")
    assert split.rows == 3 and len(shards.files(split.dir.path)) == 1
    pd.testing.assert_frame_equal(shards.read(split.dir.path), frame)
    empty = shards.write(frame.head(0), "empty")
    assert empty.rows == 0 and shards.read(empty.dir.path).empty


def test_the_context_decides_rank_and_world(tmp_path):
    units = _split(tmp_path)
    data = TrainData(
        torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0), stream=Stream(units, units, FEATURES)
    )
    loader = data.train_loader(TrainConfig(batch_size=16), DistContext(rank=1, world_size=2))
    assert loader.dataset.rank == 1 and loader.dataset.world == 2
    same = data.train_loader(TrainConfig(batch_size=16), DistContext(rank=1, world_size=2), shard=False)
    assert same.dataset.rank == 0 and same.dataset.world == 1  # pipelining: every stage the same batches


# --- preparing streamed data: chunk by chunk, the same verdicts as in memory -----------------------


def _streamed(cfg, rows: int):
    """A streamed table prepared as the pipeline prepares it: as examples of a field per column,
    the plugin's chunks of `rows` rows one after another in one shard, then combined."""
    from flyscale.data import example_combine, example_prep, source, table_examples
    from flyscale.data.reference import Reference

    r, info = cfg.plugin, table_examples.fields_of(source.info(cfg))
    batches = table_examples.batches(r.plugin.chunks(r.options, rows=rows), info, f"dataset {cfg.dataset!r}")
    return example_combine.combine([example_prep.prepare_shard(batches, cfg, info)], cfg, info, Reference())


def test_streamed_validation_quarantines_exactly_what_in_memory_validation_does(tmp_path):
    from flyscale.config import DataConfig
    from flyscale.data import source as data
    from flyscale.data.prepare import prepare_table

    rng = np.random.default_rng(0)
    first_row = None  # of the first file, once written
    for i in range(3):
        frame = pd.DataFrame(rng.random((400, 3)), columns=["f0", "f1", "f2"]).assign(target=np.arange(400) % 3)
        frame.loc[7 + i, "f0"] = np.nan
        frame.loc[20 + i, "f1"] = 5.0
        frame.loc[30, "target"] = 9
        if i == 2:
            frame.iloc[50] = frame.iloc[60].to_numpy()  # a duplicate within a file
            frame.iloc[70] = first_row  # and one of a row in another file
        if i == 0:
            first_row = frame.iloc[0].to_numpy()
        frame.to_parquet(tmp_path / f"part-{i}.parquet", index=False, row_group_size=128)
    options = {"path": str(tmp_path), "label": "target", "ranges": {"f1": [0.0, 1.0]}}
    memory_cfg = DataConfig(dataset="parquet", options=options, max_quarantine_fraction=0.5)
    stream_cfg = DataConfig(dataset="parquet_stream", options=options, max_quarantine_fraction=0.5)
    frame, info = data.load(memory_cfg)
    whole = prepare_table(frame, memory_cfg, info)
    in_memory, memory_report = shards.read(whole.quarantined.dir.path), whole.report
    prepared = _streamed(stream_cfg, rows=100)
    streamed = shards.read(prepared.quarantined.dir.path)
    origin = lambda q: sorted(zip(q["source_file"], q["source_row"]))  # noqa: E731
    assert origin(streamed) == origin(in_memory) and len(streamed) == 3 * 3 + 2
    # The same reasons, in the same words: the table's row schema judged each chunk.
    reasons = lambda q: sorted(zip(q["source_file"], q["source_row"], q["reason"]))  # noqa: E731
    assert reasons(streamed) == reasons(in_memory)
    report = prepared.report
    assert (report.total_rows, report.valid_rows, report.quarantined_rows) == (1200, 1200 - 11, 11)
    assert prepared.train.rows + prepared.val.rows + prepared.test.rows == report.valid_rows  # nothing lost
    assert 0.1 < prepared.test.rows / report.valid_rows < 0.3 and 0.05 < prepared.val.rows / report.valid_rows < 0.25
    assert report.checks == memory_report.checks and len(report.checks) == 4  # three rules and duplicates
    assert prepared.profile.rows == report.valid_rows and set(prepared.profile.features) == {"f0", "f1", "f2"}
    # The splits hold the table's columns, as training reads them.
    train = shards.read(prepared.train.dir.path)
    assert {"f0", "f1", "f2", "label"} <= set(train.columns) and len(train) == prepared.train.rows
    # Split by where each row came from: the same data always splits the same way.
    again = _streamed(stream_cfg, rows=300)
    assert (again.train.rows, again.val.rows, again.test.rows) == (
        prepared.train.rows,
        prepared.val.rows,
        prepared.test.rows,
    )


def test_a_streamed_duplicate_is_quarantined_within_a_chunk_across_chunks_and_across_files(tmp_path):
    """The true duplicates are quarantined wherever their twin was kept; rows that only share a
    hash are kept (the same code as typed examples': tests/test_examples.py holds that)."""
    from flyscale.config import DataConfig
    from flyscale.data.prepared import DUPLICATE

    rng = np.random.default_rng(1)
    files = [
        pd.DataFrame(rng.random((200, 2)), columns=["f0", "f1"]).assign(target=np.arange(200) % 2) for _ in range(3)
    ]
    files[1].iloc[20] = files[1].iloc[10].to_numpy()  # within one chunk
    files[1].iloc[150] = files[1].iloc[40].to_numpy()  # across chunks of one file
    files[2].iloc[5] = files[0].iloc[3].to_numpy()  # across files
    for i, frame in enumerate(files):
        frame.to_parquet(tmp_path / f"part-{i}.parquet", index=False)
    out = _streamed(DataConfig(dataset="parquet_stream", options={"path": str(tmp_path), "label": "target"}), 100)
    quarantined = shards.read(out.quarantined.dir.path)
    part = lambda i: str(tmp_path / f"part-{i}.parquet")  # noqa: E731
    # Each reason names the row it repeats.
    assert dict(zip(zip(quarantined["source_file"], quarantined["source_row"]), quarantined["reason"])) == {
        (part(1), 20): f"{DUPLICATE} ({part(1)} row 10)",
        (part(1), 150): f"{DUPLICATE} ({part(1)} row 40)",
        (part(2), 5): f"{DUPLICATE} ({part(0)} row 3)",
    }
    assert out.report.checks == {DUPLICATE: 3}
    assert (out.report.valid_rows, out.report.quarantined_rows) == (597, 3)


def test_validation_batches_hold_every_streamed_row_in_order(tmp_path):
    """What the pipeline strategy's stages validate on (each rank all of it, the same): every
    row of the validation shards once, in order, in batches of at most the size asked for."""
    units = _split(tmp_path)
    data = TrainData(
        torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0), stream=Stream(units, units, FEATURES)
    )
    batches = list(data.val_batches(batch_size=50))
    assert all(len(xb) == len(yb) <= 50 for xb, yb in batches)
    rows = torch.cat([xb[:, 0] for xb, _ in batches]).long()
    assert rows.tolist() == list(range(1000))
    assert torch.cat([yb for _, yb in batches]).tolist() == [i % 3 for i in range(1000)]


def test_too_few_rows_to_stream_a_batch_to_every_worker_is_an_error_that_says_so(tmp_path):
    units = _split(tmp_path, rows=100)
    with pytest.raises(
        ValueError, match=r"100 rows, streamed, give each of 2 rank\(s\) x 2 loader worker\(s\) 25 rows"
    ):
        StreamingShards(units, FEATURES, 32, rank=0, world=2, workers=2, seed=0)
