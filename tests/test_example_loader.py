"""Training batches of typed examples: augmented as they are drawn (never stored), seeded by where
they are drawn, in memory and streamed; images kept encoded are decoded by the loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import AugmentConfig, DataConfig, TrainConfig
from flyscale.data import example_combine, example_prep, fields, shards
from flyscale.data.augment import on_the_fly
from flyscale.data.reference import Reference
from flyscale.plugin import registry
from flyscale.train.batches import train_data_from
from flyscale.train.distributed import DistContext, set_epoch
from flyscale_plugins.images import ShapesOptions, generate
from tests.test_examples import _batch

IMAGE = FieldSpec("image", "uint8", [3, 8, 8], "png", [0, 255])
INFO = DatasetInfo("png", 4, [3, 8, 8], [], fields=[IMAGE, FieldSpec("label", "int64", [])], input_field="image")
NOISE = AugmentConfig(names=["noise"], options={"noise": {"std": 0.5}}, seed=7)


class _Draw:
    """An augmentation whose output is its first random draw: each batch shows its own seed."""

    def __call__(self, x, rng, options):
        return np.full_like(x, rng.random())


@pytest.fixture
def draws():
    """The augmentation above, registered for one test (the registry is the process's)."""
    registry.augmentations.register("t_draw", _Draw())
    yield AugmentConfig(names=["t_draw"], seed=7)
    registry.augmentations.unregister("t_draw")


def _splits(streaming: bool, keep_encoded: bool = False):
    images, labels = generate(400, ShapesOptions(size=8))
    png = [fields.encode_png(x) for x in images]
    cfg = DataConfig(dataset="shapes", streaming=streaming, keep_encoded=keep_encoded)
    part = example_prep.prepare_shard([_batch(png, labels.tolist(), "a")], cfg, INFO, keep_encoded=keep_encoded)
    prepared = example_combine.combine([part], cfg, INFO, Reference())
    for s in (prepared.train, prepared.val):
        s.streamed = streaming
    return prepared, images


def _epochs(data, cfg: TrainConfig, epochs: int = 2) -> list[list[np.ndarray]]:
    loader = data.train_loader(cfg, DistContext())
    out = []
    for epoch in range(epochs):
        set_epoch(loader, epoch)
        out.append([x.numpy().copy() for x, _ in loader])
    return out


@pytest.fixture(scope="module")
def in_memory():
    return _splits(streaming=False)


@pytest.mark.timeout(120)
def test_in_memory_batches_are_augmented_as_drawn_the_same_whatever_the_workers(in_memory, draws):
    prepared, _ = in_memory
    plain = train_data_from(prepared.train, prepared.val, INFO)
    augmented = train_data_from(prepared.train, prepared.val, INFO, on_the_fly(NOISE, INFO))
    cfg = TrainConfig(batch_size=64)
    before, after = _epochs(plain, cfg), _epochs(augmented, cfg)
    assert all(a.shape == b.shape for a, b in zip(before[0], after[0], strict=True))
    assert not np.allclose(before[0][0], after[0][0])  # augmented...
    assert all(0.0 <= a.min() and a.max() <= 1.0 for a in after[0])  # ...and clipped back into the pixels' range
    # Each batch its own seed, new every epoch; the same with DataLoader workers gathering the rows:
    # seeds follow (epoch, batch), not the process.
    seeds = train_data_from(prepared.train, prepared.val, INFO, on_the_fly(draws, INFO))
    draws = [[float(x.flat[0]) for x in epoch] for epoch in _epochs(seeds, cfg)]
    assert len(set(draws[0]) | set(draws[1])) == 2 * len(draws[0])
    assert draws == [[float(x.flat[0]) for x in e] for e in _epochs(seeds, TrainConfig(batch_size=64, num_workers=2))]
    # The stored training split is untouched: nothing was materialised.
    x, _ = fields.reader(INFO).read(shards.read_table(prepared.train.dir.path, ["image", "label"]))
    assert np.array_equal(torch.from_numpy(x), plain.x_train)


@pytest.mark.timeout(120)
def test_streamed_images_kept_encoded_are_decoded_and_augmented_in_the_workers():
    prepared, images = _splits(streaming=True, keep_encoded=True)
    cfg = TrainConfig(batch_size=32, num_workers=2)
    plain = train_data_from(prepared.train, prepared.val, INFO)
    augmented = train_data_from(prepared.train, prepared.val, INFO, on_the_fly(NOISE, INFO))
    assert plain.stream is not None and augmented.stream is not None
    decoded = _epochs(plain, cfg, epochs=1)[0]
    # Every streamed image is one of the originals, decoded from its PNG in a worker.
    originals = {x.astype("float32").tobytes() for x in images / np.float32(255)}
    assert all(x.astype("float32").tobytes() in originals for batch in decoded for x in batch)
    first, again = _epochs(augmented, cfg), _epochs(augmented, cfg)
    assert all(np.array_equal(a, b) for a, b in zip(first[0], again[0], strict=True))  # seeded
    assert not any(np.allclose(a, b) for a, b in zip(first[0], first[1], strict=True))  # new each epoch
    assert not np.allclose(np.sort(np.concatenate(decoded).ravel()), np.sort(np.concatenate(first[0]).ravel()))
