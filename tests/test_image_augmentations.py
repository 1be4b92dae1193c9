"""The image augmentations applied to training batches as they are drawn (random_crop, hflip,
color_jitter): each against what it promises, random_crop against a slow per-image reference."""

from __future__ import annotations

import re

import numpy as np
import pytest

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import AugmentConfig
from flyscale.data.augment import on_the_fly
from flyscale.plugin import registry

NAMES = ["random_crop", "hflip", "color_jitter"]
# Not square, so a mix-up of H and W shows.
IMAGES = np.random.default_rng(0).random((48, 3, 7, 9), dtype=np.float32)


def _apply(name: str, x: np.ndarray, seed: int = 0, **options) -> np.ndarray:
    plugin = registry.augmentations.get(name)
    return plugin(x, np.random.default_rng(seed), plugin.options_type(**options))


@pytest.mark.parametrize("name", NAMES)
def test_each_keeps_shape_and_float32_is_a_pure_function_of_the_seed_and_leaves_its_input(name):
    before = IMAGES.copy()
    out = _apply(name, IMAGES, seed=1)
    assert out.shape == IMAGES.shape and out.dtype == np.float32
    assert not np.array_equal(out, IMAGES)  # the defaults change something
    assert np.array_equal(out, _apply(name, IMAGES, seed=1))
    assert not np.array_equal(out, _apply(name, IMAGES, seed=2))
    assert np.array_equal(IMAGES, before)
    assert _apply(name, IMAGES.astype(np.float64), seed=1).dtype == np.float32


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(4, 64), (4, 8, 8), (2, 1, 3, 8, 8)])
def test_each_refuses_what_is_not_a_batch_of_images_naming_itself_and_the_shape(name, shape):
    with pytest.raises(ValueError, match=rf"augmentation '{name}' needs image batches .*{re.escape(str(shape))}"):
        _apply(name, np.zeros(shape, dtype=np.float32))


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("random_crop", {"padding": -1}, "padding"),
        ("random_crop", {"padding": 1.5}, "padding"),
        ("random_crop", {"fill": "wrap"}, "fill"),
        ("hflip", {"p": 1.5}, "p"),
        ("hflip", {"p": -0.1}, "p"),
        ("color_jitter", {"brightness": -0.1}, "brightness"),
        ("color_jitter", {"contrast": float("nan")}, "contrast"),
        ("color_jitter", {"saturation": float("inf")}, "saturation"),
    ],
)
def test_bad_options_name_the_option(name, options, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        registry.augmentations.get(name).options_type(**options)


# ---------------------------------------------------------------- random_crop


def _source(positions: np.ndarray, size: int, fill: str) -> np.ndarray:
    """Where each padded position reads from in an axis of `size` pixels; -1 for a zero."""
    if fill == "reflect":  # mirrored about the edge pixel, which is not repeated
        positions = np.abs(positions)
        positions = np.where(positions >= size, 2 * (size - 1) - positions, positions)
        return positions
    return np.where((positions >= 0) & (positions < size), positions, -1)


def _crop_reference(image: np.ndarray, padding: int, fill: str, top: int, left: int) -> np.ndarray:
    """One (C, H, W) image padded, then cropped at (top, left) of the padded image."""
    _, h, w = image.shape
    rows = _source(np.arange(h) + top - padding, h, fill)
    cols = _source(np.arange(w) + left - padding, w, fill)
    out = image[:, rows][:, :, cols]
    out[:, rows < 0] = 0.0
    out[:, :, cols < 0] = 0.0
    return out


@pytest.mark.parametrize("fill", ["zero", "reflect"])
def test_random_crop_shifts_each_image_by_its_own_offset(fill):
    p = 2
    out = _apply("random_crop", IMAGES, padding=p, fill=fill)
    offsets = []
    for image, cropped in zip(IMAGES, out):
        found = [
            (top, left)
            for top in range(2 * p + 1)
            for left in range(2 * p + 1)
            if np.array_equal(cropped, _crop_reference(image, p, fill, top, left))
        ]
        assert len(found) == 1, f"no unique padded crop of the input gives this image: {found}"
        offsets += found
    assert len(set(offsets)) >= 10  # of 25: images draw their own offsets
    assert {top for top, _ in offsets} >= {0, 2 * p} and {left for _, left in offsets} >= {0, 2 * p}


def test_random_crop_without_padding_is_the_identity():
    assert np.array_equal(_apply("random_crop", IMAGES, padding=0), IMAGES)


# ---------------------------------------------------------------- hflip


def test_hflip_flips_all_none_or_about_half():
    assert np.array_equal(_apply("hflip", IMAGES, p=1.0), IMAGES[..., ::-1])
    assert np.array_equal(_apply("hflip", IMAGES, p=0.0), IMAGES)
    x = np.random.default_rng(1).random((1000, 1, 2, 3), dtype=np.float32)
    out = _apply("hflip", x, p=0.5)
    flipped = np.all(out == x[..., ::-1], axis=(1, 2, 3))
    assert np.all(flipped | np.all(out == x, axis=(1, 2, 3)))  # each image whole, flipped or not
    assert 400 < flipped.sum() < 600  # binomial(1000, 0.5): 6 standard deviations either side


# ---------------------------------------------------------------- color_jitter


def _grey(x: np.ndarray) -> np.ndarray:
    return np.tensordot([0.2989, 0.587, 0.114], x, axes=([0], [1])) if x.shape[1] == 3 else x[:, 0]


def test_color_jitter_with_no_change_asked_is_the_identity_and_stays_in_range():
    assert np.array_equal(_apply("color_jitter", IMAGES, brightness=0, contrast=0, saturation=0), IMAGES)
    strong = _apply("color_jitter", IMAGES, brightness=0.9, contrast=0.9, saturation=0.9)
    assert strong.min() == 0.0 and strong.max() == 1.0  # clipped, and clipping was needed
    for name in ("brightness", "contrast", "saturation"):
        alone = _apply("color_jitter", IMAGES, **{"brightness": 0, "contrast": 0, "saturation": 0, name: 0.9})
        assert 0.0 <= alone.min() and alone.max() <= 1.0, name


def test_color_jitter_brightness_scales_each_image_by_a_factor_in_range():
    x = 0.1 + 0.4 * IMAGES  # in [0.1, 0.5]: x 1.5 is never clipped
    out = _apply("color_jitter", x, brightness=0.5, contrast=0, saturation=0)
    per_image = (out / x).reshape(len(x), -1)  # one factor for every pixel of an image
    np.testing.assert_allclose(per_image, np.broadcast_to(per_image[:, :1], per_image.shape), rtol=1e-5)
    assert 0.5 <= per_image.min() and per_image.max() <= 1.5 and per_image[:, 0].std() > 0.1


def test_color_jitter_contrast_keeps_the_mean_grey_and_saturation_the_grey_image():
    x = 0.25 + 0.5 * IMAGES  # far enough from 0 and 1 that factors in [0.8, 1.2] never clip
    contrast = _apply("color_jitter", x, brightness=0, contrast=0.2, saturation=0)
    np.testing.assert_allclose(_grey(contrast).mean(axis=(1, 2)), _grey(x).mean(axis=(1, 2)), atol=1e-5)
    spread = _grey(contrast).std(axis=(1, 2)) / _grey(x).std(axis=(1, 2))
    assert 0.8 <= spread.min() and spread.max() <= 1.2 and spread.std() > 0.05
    saturation = _apply("color_jitter", x, brightness=0, contrast=0, saturation=0.2)
    np.testing.assert_allclose(_grey(saturation), _grey(x), atol=1e-4)
    assert not np.allclose(saturation, x, atol=1e-3)
    grey = x[:, :1]
    assert np.array_equal(_apply("color_jitter", grey, brightness=0, contrast=0, saturation=0.5), grey)


def test_color_jitter_refuses_images_neither_grey_nor_rgb():
    with pytest.raises(ValueError, match=r"color_jitter.*1 or 3 channels"):
        _apply("color_jitter", np.zeros((2, 2, 4, 4), dtype=np.float32))


# ---------------------------------------------------------------- through config


def test_config_finds_all_three_by_name_and_chains_them_on_a_batch():
    assert set(NAMES) <= set(registry.augmentations.names())
    image = FieldSpec("image", "uint8", [3, 7, 9], "png", [0, 255])
    info = DatasetInfo("png", 4, [3, 7, 9], [], fields=[image, FieldSpec("label", "int64", [])], input_field="image")
    cfg = AugmentConfig(names=NAMES, options={"random_crop": {"padding": 2, "fill": "reflect"}}, seed=3)
    augment = on_the_fly(cfg, info)
    assert augment is not None and augment.plugins[0].options.padding == 2  # options parsed from config
    out = augment(IMAGES.copy(), (0, 0, 0, 0))
    assert out.shape == IMAGES.shape and out.dtype == np.float32 and not np.allclose(out, IMAGES)
    assert np.array_equal(out, augment(IMAGES.copy(), (0, 0, 0, 0)))
