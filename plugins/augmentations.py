"""Built-in augmentations. Each takes a batch shaped (N, *input_shape) and a numpy Generator,
so the whole augmented split is a pure function of (data, config, seed)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


shift = Shift()
rotation = Rotation()
noise = GaussianNoise()
gaussian_noise = TabularGaussianNoise()
