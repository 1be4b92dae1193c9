"""What every config section shares: strict construction, strict decoding, and its plugin,
resolved once.

A section is a pydantic dataclass in strict mode (`section`): a dataclass to flytekit, which
carries it between tasks as it carries any dataclass, and a validated type on every way in.
pydantic rather than more checks of our own: it knows every annotation (`list[str] | None`,
nested sections, a plugin's own options dataclass), and a `BaseModel` would not do, because
`pyflyte run` decodes a BaseModel input in lax mode (`strict=False`, so `"5"` would pass for an
integer), while a dataclass input is decoded by the class's own `from_json`, which is ours.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeVar, cast, dataclass_transform

from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass

from flyscale.config.strict import STRICT, ConfigError, explain

T = TypeVar("T")


@dataclass_transform(field_specifiers=(dataclasses.field,))
def section(cls: type[T]) -> type[T]:
    """Make `cls` a config section: a pydantic dataclass, strict, refusing unknown keys."""
    return cast("type[T]", _pydantic_dataclass(cls, config=STRICT))  # pydantic's overloads lose the type


class _StrictConstruction(type):
    """Keyword arguments of the wrong type, or that a section does not have, are refused with
    the field named (and the nearest field's name), instead of pydantic's own report."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            raise ConfigError(explain(exc, cls, getattr(cls, "_section", ""))) from None


class Section(metaclass=_StrictConstruction):
    """A config section. Sections that name a plugin resolve it once, when they are built
    (validation and every later use share the result); the resolution never travels in a pickle,
    so a worker process resolves through its own registry."""

    _section = ""
    _what = "field"

    @classmethod
    def from_json(cls, text: str) -> Any:
        """The section from JSON, strictly. `pyflyte run --cfg` (a YAML or JSON file, or inline
        JSON) builds the workflow input through this method when the class has one."""
        return decode(cls, json.loads(text))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_resolved"}

    def _resolved_once(self, key: Any, resolve_fn: Callable[[], Any]) -> Any:
        # Keyed on the fields it came from, so a section edited after it was built resolves again.
        cached = self.__dict__.get("_resolved")
        if cached is None or cached[0] != key:
            cached = (key, resolve_fn())
            self.__dict__["_resolved"] = cached
        return cached[1]


def decode(cls: type[T], data: Any) -> T:
    """`cls` from plain data (a YAML or JSON mapping), strictly: the errors name every field."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: the config holds a value that is not plain data ({exc})") from None
    try:
        return _adapter(cls).validate_json(text)
    except ValidationError as exc:
        raise ConfigError(explain(exc, cls, getattr(cls, "_section", ""))) from None


_ADAPTERS: dict[type, TypeAdapter] = {}


def _adapter(cls: type) -> TypeAdapter:
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def positive(obj: Any, *names: str) -> None:
    """Each of `names` must be > 0."""
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{obj._section}.{name} must be > 0, got {getattr(obj, name)!r}")


def fraction(obj: Any, name: str, *, lo: float = 0.0, hi: float = 1.0) -> None:
    """`name` must lie in [lo, hi]."""
    value = getattr(obj, name)
    if not lo <= value <= hi:
        raise ValueError(f"{obj._section}.{name} must be in [{lo}, {hi}], got {value!r}")
