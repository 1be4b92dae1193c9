"""Strict config: a wrong type or an unknown key is refused, with the field, what was expected
and what was given, and the nearest name for a typo.

Types are checked by pydantic in strict mode (`STRICT`): an integer field takes an integer, not
`2.5` and not `"5"`; a float field takes any number. Every way config comes in goes through it:
keyword arguments, `config.from_dict`, and the JSON that `pyflyte run --cfg` hands to a section's
`from_json`. pydantic's own messages are rewritten here into one line per problem:

    train.epochs: expected an integer, got 2.5
    train.epoch: unknown field; did you mean 'epochs'? expected one of ...
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import click
from pydantic import ConfigDict, ValidationError

from flyscale.errors import UserError

# Every section's pydantic config: types checked strictly, unknown keys refused.
STRICT = ConfigDict(strict=True, extra="forbid")


class ConfigError(click.BadParameter, UserError):
    """Bad config, as a ValueError for Python callers and as a usage error for pyflyte's command
    line, which then prints the message alone instead of a traceback (unless asked for one)."""

    def format_message(self) -> str:
        # "Invalid value for '--cfg': ...", with the traceback first when asked for.
        return self.with_traceback_if_asked(click.BadParameter.format_message(self))


def unknown_key(where: str, key: str, known: Iterable[str], what: str = "field") -> str:
    """`where.key: unknown field; did you mean 'x'? (expected one of ...)` for a key not in `known`."""
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    head = f"{where}.{key}: unknown {what}" if where else f"unknown {what} {key!r}"
    return f"{head}; {hint}expected one of {', '.join(known) or '(none)'}"


def check_keys(where: str, given: Mapping | Iterable[str], known: Iterable[str], what: str = "field") -> None:
    """Raise ConfigError for the first key of `given` that is not in `known`."""
    known = list(known)
    for key in given:
        if key not in known:
            raise ConfigError(unknown_key(where, str(key), known, what))


# What each of pydantic's error types expected, in words.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "tuple_type": "a list",
    "set_type": "a list",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
    "dataclass_exact_type": "a mapping",
    "model_type": "a mapping",
    "none_required": "null",
    "json_type": "JSON",
}
_UNKNOWN = {"extra_forbidden", "unexpected_keyword_argument"}


def _fields_at(root: type, path: list[str | int]) -> tuple[type | None, str]:
    """The dataclass found at `path` inside `root` (following list items), and what its keys are
    called ("config section" at the top of a pipeline config, else "field")."""
    cls: Any = root
    for part in path:
        if isinstance(part, int):
            continue
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None, "field"
        cls = hints[part]
        while typing.get_origin(cls) is not None:  # list[GateConfig], GateConfig | None
            args = [a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)]
            cls = args[0] if args else None
            if cls is None:
                return None, "field"
    return (cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None), getattr(cls, "_what", "field")


def _problem(error: Mapping[str, Any], root: type | None, prefix: str) -> str:
    # pydantic puts a union member's name in the path ("list[str]"): only field names and indexes stay.
    path = [p for p in error["loc"] if isinstance(p, int) or (isinstance(p, str) and p.isidentifier())]
    where = ".".join([prefix, *map(str, path)] if prefix else map(str, path))
    kind = error["type"]
    if kind in _UNKNOWN:
        parent, what = _fields_at(root, path[:-1]) if root is not None else (None, "field")
        known = [f.name for f in dataclasses.fields(parent)] if parent is not None else []
        return unknown_key(where.rpartition(".")[0], str(path[-1]), known, what)
    if kind == "value_error":  # raised by a section's own checks: its message names the field
        message = str(error.get("ctx", {}).get("error", error["msg"]))
        return message if (not where or message.startswith(where.split(".")[0])) else f"{where}: {message}"
    if kind == "missing":
        return f"{where}: required, and not given"
    expected = _EXPECTED.get(kind)
    if expected is None:
        return f"{where}: {error['msg']}"
    return f"{where}: expected {expected}, got {error['input']!r}"


def explain(exc: ValidationError, root: type | None = None, prefix: str = "") -> str:
    """pydantic's errors as one line per problem, each naming the field (`prefix` + its path)."""
    problems = list(dict.fromkeys(_problem(e, root, prefix) for e in exc.errors()))
    return "\n".join(problems)
