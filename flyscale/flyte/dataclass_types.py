"""flyscale's dataclasses as Flyte types, each with its literal type built once per process.

flytekit describes a dataclass in a task's interface by a JSON schema it builds afresh for every
interface the type appears in; PipelineConfig and its sections appear in most of the twelve
tasks, and rebuilding their schemas cost about a second of every `pyflyte run` (and of every task
pod's start on a cluster). The transformer below is flytekit's own dataclass transformer,
registered through flytekit's public `TypeEngine.register` for one type at a time, that keeps
the literal type it built: in the process, and on disk (flyscale.flyte.memo) keyed by flyscale's source
and the versions of the libraries that build it, since building 32 schemas still took 0.3 s of
each process. Everything else (serialising values, reading them back) is unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, get_args, get_origin

from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.types import LiteralType

from flyscale.flyte import memo
from flyscale.flyte.caching import library_versions, source_hash

# What a dataclass's literal type is built by, besides flyscale's own code.
BUILDERS = ("flytekit", "flyteidl", "mashumaro", "pandera", "pandas", "pyarrow")


@functools.cache
def _builder_version() -> str:
    """flyscale's source (every module: a field's type may live in any) and the builders' versions."""
    package = Path(__file__).resolve().parents[1]  # all of flyscale: a field's type may live in any module
    modules = {str(path.relative_to(package)): str(path) for path in package.rglob("*.py")}
    return f"{source_hash(modules)} {sorted(library_versions(BUILDERS).items())}"


def _encode(literal_type: LiteralType) -> bytes:
    return literal_type.to_flyte_idl().SerializeToString()


def _decode(data: bytes) -> LiteralType:
    from flyteidl.core import types_pb2
    from google.protobuf.message import DecodeError

    try:
        return LiteralType.from_flyte_idl(types_pb2.LiteralType.FromString(data))
    except DecodeError as exc:
        raise ValueError(str(exc)) from exc


class SchemaOnceTransformer(DataclassTransformer):
    """flytekit's DataclassTransformer for exactly one dataclass, building its literal type once."""

    def __init__(self, python_type: type):
        super().__init__()
        self._t = python_type  # what TypeEngine files this transformer under
        self._name = f"{python_type.__qualname__} (dataclass)"
        self._literal_type: LiteralType | None = None

    def get_literal_type(self, t) -> LiteralType:
        if get_origin(t) is Annotated and get_args(t)[0] is self._t:
            t = self._t  # an output keyed by content (a HashMethod): flytekit drops the annotation too
        if t is not self._t:  # a generic variant: not ours to remember
            return super().get_literal_type(t)
        if self._literal_type is None:
            key = memo.key(_builder_version(), t.__module__, t.__qualname__)
            self._literal_type = memo.remembered(
                "flyte-types", key, lambda: super(SchemaOnceTransformer, self).get_literal_type(t), _encode, _decode
            )
        return self._literal_type


def register(*types: type) -> None:
    """Register each dataclass with a SchemaOnceTransformer (again is a no-op)."""
    for t in types:
        try:
            TypeEngine.register(SchemaOnceTransformer(t))
        except ValueError:  # registered already (flytekit refuses a second transformer for a type)
            pass
