"""What a request sent, read without trusting it: an array of numbers (or of encoded images), or
a list of prompts. Each refusal is an InvalidInput that names the problem and never the input."""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

import numpy as np

from .errors import InvalidInput


def whole(value: Any) -> bool:
    """An int, or a float with no fraction (JSON and MLflow's param casting may make 5 into 5.0)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer()


def said(value: Any) -> str:
    """A param's value as a message quotes it: short, whatever was sent."""
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."


def kind_of(value: Any) -> str:
    """What a value is, in words, without the value."""
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return "true/false"
    if isinstance(value, (int, float, np.number)):
        return "a number"
    names: dict[type, str] = {list: "a list", dict: "an object", bytes: "bytes", str: "text"}
    return names.get(type(value), f"a {type(value).__name__}")


def as_array(model_input: Any) -> np.ndarray:
    """What was sent, as one array: numbers with the dtype they came with (integers stay
    integers: they are pixels 0-255 for an image model), or an object array of bytes and strings."""
    if isinstance(model_input, dict):  # MLflow hands the signature's one named input as {name: array}
        if len(model_input) != 1:
            raise InvalidInput(f"named inputs {sorted(model_input)[:5]}: send one array of examples")
        model_input = next(iter(model_input.values()))
    columns = getattr(model_input, "columns", None)
    if columns is not None:  # a DataFrame: its columns of numbers, or one column of files or arrays
        if len(columns) == 1 and len(model_input):
            cells = list(model_input.iloc[:, 0])
            if any(isinstance(c, (list, tuple, np.ndarray, bytes, str)) for c in cells):
                return as_array(cells)
        model_input = model_input.to_numpy()
    if isinstance(model_input, (bytes, str)):
        model_input = [model_input]
    if isinstance(model_input, (list, tuple)) and any(isinstance(v, (bytes, str)) for v in model_input):
        out = np.empty(len(model_input), dtype=object)  # not np.array: it would cut bytes' trailing zeros
        out[:] = list(model_input)
        return out
    x = np.asarray(model_input) if not isinstance(model_input, np.ndarray) else model_input
    if x.dtype == object:  # MLflow's parse of JSON into an object array: find the numbers' own type
        flat = x.reshape(-1)
        if any(isinstance(v, (bytes, str)) for v in flat):
            return x
        try:
            x = np.asarray(x.tolist())
        except ValueError:
            raise InvalidInput("the examples differ in shape: every one must have the same") from None
        if x.dtype == object:  # missing values (null) among numbers
            try:
                x = x.astype(np.float64)
            except (TypeError, ValueError):
                raise InvalidInput("the inputs hold values that are not numbers") from None
    return x


def decode_image(value: Any, index: int, channels: int, height: int, width: int) -> np.ndarray:
    """One PNG or JPEG file (bytes, or a base64 string, a data: URL's too) as uint8 (C, H, W),
    converted as flyscale/data/fields.py decode_image converts for training; InvalidInput naming
    the example when it is not one, or not the model's size."""
    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            value = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(
                f"example {index} is a string that is not base64: send a PNG or JPEG file's bytes base64-encoded"
            ) from None
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidInput(f"example {index} is {kind_of(value)} among files: send every example the same way")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(value)) as image:  # over Pillow's pixel cap: DecompressionBombError
            if image.size != (width, height):  # before decoding: a bomb is refused by its header
                raise InvalidInput(
                    f"example {index} is a {image.size[0]}x{image.size[1]} image; this model takes {width}x{height} "
                    f"(width x height)"
                )
            image.load()
            pixels = np.asarray(image.convert("L" if channels == 1 else "RGB"), dtype="uint8")
    except InvalidInput:
        raise
    except Image.DecompressionBombError:
        raise InvalidInput(f"example {index} is an image of too many pixels to decode") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        what = "not a PNG or JPEG image" if isinstance(exc, UnidentifiedImageError) else "a broken image"
        raise InvalidInput(f"example {index} is {what}") from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def prompts_of(model_input: Any) -> list[str]:
    """Prompts as MLflow hands them: one string, a list, or a one-column DataFrame; strings only."""
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict):
        raise InvalidInput(f"named inputs {sorted(model_input)[:5]}: send prompts as a list of strings")
    columns = getattr(model_input, "columns", None)
    if columns is not None:
        if len(columns) != 1:
            raise InvalidInput(f"a language model takes one column of prompts, got {len(columns)} columns")
        model_input = list(model_input.iloc[:, 0])
    if isinstance(model_input, np.ndarray):
        prompts = list(model_input.astype(object).reshape(-1))
    else:
        prompts = list(model_input) if isinstance(model_input, (list, tuple)) else [model_input]
    if not prompts:
        raise InvalidInput("no prompts: send at least one string")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise InvalidInput(f"prompt {i} is {kind_of(p)}, not text: a language model takes strings")
    return [str(p) for p in prompts]
