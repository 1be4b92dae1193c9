"""Images, three measurements side by side with their baselines in one run.

1. The data stage: 50,000 PNG-encoded 3x32x32 images in 8 Parquet shards (the layout Hugging
   Face exports), from fingerprint to training-ready splits through flyscale's preparation (the
   `image_parquet` dataset; each shard as the map task prepares it, then the combine), against a
   floor made in the same run: pyarrow reads the same shards, PIL decodes every image, and
   pyarrow writes the uint8 arrays back as Parquet. Goal: <= 2x the floor.
2. The loader: streamed splits that keep the PNGs (`data.keep_encoded`), decoded, randomly
   cropped and flipped in 2 DataLoader workers, in images a second, against the images a second
   the ResNet of configs/images-resnet.yaml trains at on the same cores. Goal: >= 3x.
3. The new user's case: configs/images-resnet.yaml (3,000 generated images, PNG-encoded, the
   small ResNet, 3 epochs) under an uncached `pyflyte run`, its wall time broken down
   (benchmarks/timeline.py). Goal: the data stages take <= 2x the training time.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from flyscale.config import AugmentConfig, DataConfig, TrainConfig
from flyscale.data import example_combine, example_prep, fields, source
from flyscale.data.augment import on_the_fly
from flyscale.data.reference import Reference
from flyscale.model import build_model
from flyscale.train.batches import train_data_from
from flyscale.train.distributed import DistContext, set_epoch
from flyscale_plugins.images import ShapesOptions, generate

IMAGES, SHARDS = 50_000, 8
STAGE_GOAL, LOADER_GOAL, NEW_USER_GOAL = 2.0, 3.0, 2.0
ROUNDS = 3


def write_shards(root: Path, images: int = IMAGES, shards: int = SHARDS) -> Path:
    """`images` generated 3x32x32 images as PNG bytes, in `shards` Parquet files of (image, label)."""
    root.mkdir(parents=True, exist_ok=True)
    per = images // shards
    for s in range(shards):
        pixels, labels = generate(per, ShapesOptions(size=32, seed=1), chunk=s)
        png = [fields.encode_png(x) for x in pixels]
        table = pa.table({"image": pa.array(png, pa.binary()), "label": pa.array(labels)})
        pq.write_table(table, root / f"part-{s:05d}.parquet")
    return root


def floor(root: Path, out: Path) -> int:
    """pyarrow reads the shards, PIL decodes every image, pyarrow writes the uint8 arrays back."""
    import io

    from PIL import Image

    rows = 0
    for f in sorted(root.glob("*.parquet")):
        table = pq.read_table(f)
        pixels = np.stack(
            [
                np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).transpose(2, 0, 1)
                for b in table["image"].to_pylist()
            ]
        )
        column = pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), 3 * 32 * 32)
        pq.write_table(pa.table({"image": column, "label": table["label"]}), out / f.name)
        rows += len(pixels)
    return rows


def flyscale_stage(cfg: DataConfig) -> int:
    """Fingerprint, then every shard as the map task prepares it, then the combine: the splits."""
    source.fingerprint(cfg)
    info = source.info(cfg)
    parts = [
        example_prep.prepare_shard(source.examples(cfg, s), cfg, info, i, s) for i, s in enumerate(source.shards(cfg))
    ]
    prepared = example_combine.combine(parts, cfg, info, Reference())
    return prepared.train.rows + prepared.val.rows + prepared.test.rows


def data_stage(root: Path) -> None:
    cfg = DataConfig(dataset="image_parquet", options={"path": str(root), "num_classes": 4})
    ours, base = [], []
    for _ in range(ROUNDS):  # interleaved, so machine drift hits both alike
        start = time.perf_counter()
        kept = flyscale_stage(cfg)
        ours.append(time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            floor(root, Path(out))
            base.append(time.perf_counter() - start)
    o, b = statistics.median(ours), statistics.median(base)
    verdict = "met" if o / b <= STAGE_GOAL else "NOT met"
    print(
        f"  data stage  {IMAGES} PNGs in {SHARDS} shards: flyscale {o:.1f} s ({IMAGES / o:,.0f} images/s, {kept} kept)   "
        f"floor {b:.1f} s   ratio {o / b:.2f} (medians of {ROUNDS}; goal <= {STAGE_GOAL}: {verdict})"
    )


def _prepared(root: Path, keep_encoded: bool) -> tuple:
    cfg = DataConfig(
        dataset="image_parquet",
        options={"path": str(root), "num_classes": 4},
        streaming=True,
        keep_encoded=keep_encoded,
    )
    info = source.info(cfg)
    parts = [
        example_prep.prepare_shard(source.examples(cfg, s), cfg, info, i, s, keep_encoded)
        for i, s in enumerate(source.shards(cfg))
    ]
    return example_combine.combine(parts, cfg, info, Reference()), info


def loader_rate(root: Path) -> float:
    """Images a second out of the loader: PNGs decoded, cropped and flipped in 2 workers."""
    prepared, info = _prepared(root, keep_encoded=True)
    augment = on_the_fly(AugmentConfig(names=["random_crop", "hflip"]), info)
    data = train_data_from(prepared.train, prepared.val, info, augment)
    loader = data.train_loader(TrainConfig(batch_size=64, num_workers=2), DistContext())
    rates = []
    for epoch in range(ROUNDS):
        set_epoch(loader, epoch)
        start, seen = time.perf_counter(), 0
        for x, _ in loader:
            seen += len(x)
        rates.append(seen / (time.perf_counter() - start))
    return statistics.median(rates)


def training_rate(steps: int = 40, batch: int = 64) -> float:
    """Images a second the preset's ResNet trains at (forward, backward, AdamW), on every core."""
    from flyscale.config import PipelineConfig
    from flyscale.config.presets import read

    cfg = PipelineConfig.from_dict(read(str(Path(__file__).parents[1] / "configs/images-resnet.yaml")))
    info = source.info(cfg.data)
    model = build_model(cfg.model, info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.rand(batch, 3, 32, 32), torch.randint(0, 4, (batch,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times[5:])


def loader(root: Path) -> None:
    feed, train = loader_rate(root), training_rate()
    verdict = "met" if feed / train >= LOADER_GOAL else "NOT met"
    print(
        f"  loader      decode + random crop + flip in 2 workers {feed:,.0f} images/s   the ResNet trains at "
        f"{train:,.0f} images/s ({torch.get_num_threads()} threads)   ratio {feed / train:.1f} "
        f"(goal >= {LOADER_GOAL}: {verdict})"
    )


def new_user(work: Path) -> None:
    from benchmarks.bench_overhead import breakdown, timed_run

    timeline = timed_run(
        work / "new-user.json",
        work / "home-new-user",
        f"sqlite:///{work / 'mlflow.db'}",
        "workflows/train.py",
        "training_pipeline",
        "--cfg",
        "configs/images-resnet.yaml",
    )
    parts = dict(breakdown(timeline))
    data = sum(v for k, v in parts.items() if k.startswith("task ") and _is_data(k))
    training = parts.get("task train_model", 0.0) + parts.get("training workers' start-up", 0.0)
    verdict = "met" if data <= NEW_USER_GOAL * training else "NOT met"
    print(
        f"  new user    configs/images-resnet.yaml, uncached pyflyte run: {timeline['end']:.1f} s; data stages "
        f"{data:.1f} s, training {training:.1f} s: {data / training:.2f}x (goal <= {NEW_USER_GOAL}x: {verdict})"
    )
    for name, seconds in parts.items():
        if abs(seconds) >= 0.05:
            print(f"                {name:<48} {seconds:6.2f} s")


def _is_data(part: str) -> bool:
    return any(
        t in part for t in ("fingerprint_data", "plan_shards", "prepare_shard", "combine_shards", "read_reference")
    )


def main() -> None:
    print("Images: the data stage, the loader and the new user's run, each beside its baseline")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = write_shards(Path(tmp) / "shards")
        data_stage(root)
        loader(write_shards(Path(tmp) / "loader", images=20_000, shards=4))
        new_user(Path(tmp))


if __name__ == "__main__":
    os.environ.setdefault("FLYTE_SDK_LOGGING_LEVEL", "40")
    main()
