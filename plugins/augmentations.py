"""Built-in augmentations. Each takes a batch shaped (N, *input_shape) and a numpy Generator,
so the whole augmented split is a pure function of (data, config, seed).

`random_crop`, `hflip` and `color_jitter` run on every training batch as it is drawn, so they
are vectorised over the batch: no Python loop per image, no scipy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def _images(x: np.ndarray, name: str) -> np.ndarray:
    if x.ndim != 4:
        raise ValueError(f"augmentation {name!r} needs image batches (N, C, H, W), got shape {x.shape}")
    return x


@dataclass
class ShiftOptions:
    max_shift: int = 1  # pixels, in each direction

    def __post_init__(self):
        if self.max_shift < 0:
            raise ValueError(f"max_shift must be >= 0, got {self.max_shift}")


class Shift:
    """Translate each image by a random whole number of pixels, filling with zeros."""

    options_type = ShiftOptions

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: ShiftOptions) -> np.ndarray:
        x = _images(x, "shift")
        out = np.zeros_like(x)
        k = options.max_shift
        shifts = rng.integers(-k, k + 1, size=(len(x), 2))
        h, w = x.shape[2:]
        for i, (dy, dx) in enumerate(shifts):
            src_y = slice(max(0, -dy), h - max(0, dy))
            dst_y = slice(max(0, dy), h - max(0, -dy))
            src_x = slice(max(0, -dx), w - max(0, dx))
            dst_x = slice(max(0, dx), w - max(0, -dx))
            out[i, :, dst_y, dst_x] = x[i, :, src_y, src_x]
        return out


@dataclass
class RotationOptions:
    max_degrees: float = 10.0

    def __post_init__(self):
        if not 0 <= self.max_degrees <= 180:
            raise ValueError(f"max_degrees must be in [0, 180], got {self.max_degrees}")


class Rotation:
    """Rotate each image by a random angle about its centre (bilinear, zero fill)."""

    options_type = RotationOptions

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: RotationOptions) -> np.ndarray:
        from scipy.ndimage import rotate

        x = _images(x, "rotation")
        angles = rng.uniform(-options.max_degrees, options.max_degrees, size=len(x))
        out = np.empty_like(x)
        for i, angle in enumerate(angles):
            out[i] = rotate(x[i], angle, axes=(1, 2), reshape=False, order=1, mode="constant", cval=0.0)
        return out


@dataclass
class NoiseOptions:
    # Relative to the data's own spread, so no unit or range is assumed: with `per_feature` off
    # the std of every value in the batch (one scale for an image's pixels), on, each feature's
    # own std (tabular columns of unrelated scales; a constant column gets no noise).
    std: float = 0.08
    per_feature: bool = False

    def __post_init__(self):
        if self.std < 0:
            raise ValueError(f"std must be >= 0, got {self.std}")


class GaussianNoise:
    """Add i.i.d. Gaussian noise to every feature, scaled to the batch's spread (any shape).

    flyscale clips the result into the dataset's declared feature ranges afterwards, so the
    noise needs no knowledge of them."""

    options_type = NoiseOptions

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: NoiseOptions) -> np.ndarray:
        scale = x.std(axis=0, keepdims=True) if options.per_feature else x.std()
        noise = rng.normal(0.0, 1.0, size=x.shape) * (options.std * scale)
        return x + noise.astype(x.dtype)


@dataclass
class TabularNoiseOptions(NoiseOptions):
    std: float = 0.05
    per_feature: bool = True


class TabularGaussianNoise(GaussianNoise):
    """Gaussian noise for tabular features: each column by its own spread."""

    options_type = TabularNoiseOptions


FILLS = ("zero", "reflect")


@dataclass
class RandomCropOptions:
    padding: int = 4  # pixels added on each side before cropping back to the original size
    fill: str = "zero"  # what the padding holds: "zero", or "reflect" (the image mirrored at its edge)

    def __post_init__(self):
        if isinstance(self.padding, bool) or not isinstance(self.padding, int) or self.padding < 0:
            raise ValueError(f"padding must be an integer >= 0, got {self.padding!r}")
        if self.fill not in FILLS:
            raise ValueError(f"fill must be one of {', '.join(FILLS)}, got {self.fill!r}")


def _pixels(x: np.ndarray, name: str) -> np.ndarray:
    """An image batch as float32 (N, C, H, W); the input itself when it already is one."""
    return np.asarray(_images(x, name), dtype=np.float32)


def _pad(x: np.ndarray, p: int, fill: str) -> np.ndarray:
    """`x` with `p` pixels more on each side of H and W."""
    if fill == "reflect":
        return np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), mode="reflect")
    n, c, h, w = x.shape
    # Three times faster than np.pad's constant mode on a CIFAR batch.
    out = np.zeros((n, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
    out[:, :, p : p + h, p : p + w] = x
    return out


class RandomCrop:
    """Pad each image, then crop it back to its size at a random offset (the CIFAR recipe)."""

    options_type = RandomCropOptions

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: RandomCropOptions) -> np.ndarray:
        x = _pixels(x, "random_crop")
        n, _, h, w = x.shape
        p = options.padding
        if p == 0:
            return x.copy()
        top, left = rng.integers(0, 2 * p + 1, size=(2, n))
        # Every (H, W) window of the padded batch as a view; one gather takes each image's own.
        windows = sliding_window_view(_pad(x, p, options.fill), (h, w), axis=(2, 3))
        return windows[np.arange(n), :, top, left]


@dataclass
class HFlipOptions:
    p: float = 0.5  # the chance that an image is flipped

    def __post_init__(self):
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {self.p}")


class HFlip:
    """Flip a random subset of the images left-right."""

    options_type = HFlipOptions

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: HFlipOptions) -> np.ndarray:
        x = _pixels(x, "hflip")
        flip = rng.random(len(x)) < options.p
        out = x.copy()
        out[flip] = x[flip, ..., ::-1]
        return out


@dataclass
class ColorJitterOptions:
    # Each the largest relative change, as in torchvision: a factor uniform in
    # [max(0, 1 - value), 1 + value] per image; 0 leaves that property alone.
    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2

    def __post_init__(self):
        for name in ("brightness", "contrast", "saturation"):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


# ITU-R 601-2 luma, the weights of torchvision's rgb_to_grayscale.
_LUMA = np.array([0.2989, 0.587, 0.114], dtype=np.float32)


def _grey(x: np.ndarray) -> np.ndarray:
    """The grey image of each image of a (N, 1 or 3, H, W) batch, shaped (N, 1, H, W)."""
    n, c, h, w = x.shape
    if c == 1:
        return x
    return np.matmul(_LUMA, x.reshape(n, c, h * w)).reshape(n, 1, h, w)


def _blend(out: np.ndarray, factor: np.ndarray, other: np.ndarray) -> None:
    """out = factor * out + (1 - factor) * other, clipped to [0, 1], in place (torchvision's blend)."""
    out *= factor
    out += (1 - factor) * other
    np.clip(out, 0.0, 1.0, out=out)


class ColorJitter:
    """Randomly change each image's brightness, then contrast, then saturation (grey or RGB).

    As torchvision does, but in that fixed order: brightness scales the pixels, contrast blends
    them with the image's mean grey level, saturation with its grey image; clipped to [0, 1]
    after each."""

    options_type = ColorJitterOptions

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: ColorJitterOptions) -> np.ndarray:
        x = _pixels(x, "color_jitter")
        if x.shape[1] not in (1, 3):
            raise ValueError(f"augmentation 'color_jitter' needs grey or RGB images (1 or 3 channels), got {x.shape}")
        strengths = np.array([[options.brightness], [options.contrast], [options.saturation]])
        factors = rng.uniform(np.maximum(0.0, 1 - strengths), 1 + strengths, size=(3, len(x)))
        brightness, contrast, saturation = factors.astype(np.float32)[:, :, None, None, None]
        out = x.copy()
        if options.brightness:  # a blend with black
            out *= brightness
            np.clip(out, 0.0, 1.0, out=out)
        if options.contrast:
            _blend(out, contrast, _grey(out).mean(axis=(1, 2, 3), keepdims=True))
        if options.saturation and x.shape[1] > 1:  # a grey image has no saturation to change
            _blend(out, saturation, _grey(out))
        return out


shift = Shift()
rotation = Rotation()
noise = GaussianNoise()
gaussian_noise = TabularGaussianNoise()
random_crop = RandomCrop()
hflip = HFlip()
color_jitter = ColorJitter()
