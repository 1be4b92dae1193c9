"""Unknown keys are errors, on every way config comes in, and the error suggests the nearest name.

A typo in a preset must not silently train the default: `train: {epoch: 3}` fails with
`train.epoch: unknown field; did you mean 'epochs'?`, whether the preset came through
`pyflyte run --cfg` (YAML or JSON), `config.from_dict`, or Python keyword arguments.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Mapping

import click


class ConfigError(click.BadParameter, ValueError):
    """Bad config, as a ValueError for Python callers and as a usage error for pyflyte's command
    line, which then prints the message alone instead of a traceback."""


def innermost_value_error(exc: BaseException) -> BaseException:
    """The ValueError that started a chain of wrappers (mashumaro wraps a field's error in its
    own 'Field x has invalid value {...}', which hides what was wrong)."""
    found = exc
    while exc is not None:
        if isinstance(exc, ValueError) and type(exc).__module__.split(".")[0] != "mashumaro":
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def unknown_key(where: str, key: str, known: Iterable[str], what: str = "field") -> str:
    """`where.key: unknown field; did you mean 'x'? (expected one of ...)` for a key not in `known`."""
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    head = f"{where}.{key}: unknown {what}" if where else f"unknown {what} {key!r}"
    return f"{head}; {hint}expected one of {', '.join(known) or '(none)'}"


def check_keys(where: str, given: Mapping | Iterable[str], known: Iterable[str], what: str = "field") -> None:
    """Raise ValueError for the first key of `given` that is not in `known`."""
    known = list(known)
    for key in given:
        if key not in known:
            raise ValueError(unknown_key(where, str(key), known, what))
