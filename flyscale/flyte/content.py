"""Content hashes for Flyte's cache keys.

Flyte keys a cached task on its input literals, and the literal of a file, a directory, a table or
a dataclass holding one is where it was written: a task that runs again and writes the same bytes
to a new place would re-run every cached task after it. A task output declared
`Annotated[T, BY_CONTENT]` (flytekit's `HashMethod`) carries a hash of its content instead, which
is all that the cache key of a task that takes it holds of it.

flytekit computes that hash only where a task's output is converted, and drops it where a field
is taken out of a record (`trained.weights`) or a @dynamic hands a value on: there the task takes
the content's hash as an input of its own, and ignores the file (see tasks/evaluate.py).

Each file is read once per process: a file's hash is remembered by its identity (inode, size,
modification and change times), so a hash taken as the file was written serves the output's.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from flytekit import HashMethod
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read once per process however often it is asked for."""
    st = os.stat(path)
    return _file_sha256(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# Keyed by the file's identity, not its path: a hard link (a split's shard linked into another
# directory) is the same file. Any write moves the change time, which no tool can set back.
@functools.lru_cache(maxsize=65_536)
def _file_sha256(path: str, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def directory_sha256(path: str | os.PathLike) -> str:
    """sha256 over every file under a directory: its path inside it and its bytes' sha256."""
    root = Path(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(root).as_posix()}\0{file_sha256(f)}\n".encode())
    return digest.hexdigest()


def _local(value: FlyteFile | FlyteDirectory) -> str:
    """A file's or directory's local path, fetched first where it is only a remote one."""
    return value.path if os.path.exists(value.path) else value.download()


def _canonical(value: Any) -> Any:
    """`value` as plain JSON, each file and directory in it as its content's hash."""
    if hasattr(value, "content_key"):  # a type that knows its content's hash (Shards: written with it)
        return value.content_key()
    if isinstance(value, FlyteFile):
        return {"file_sha256": file_sha256(_local(value))}
    if isinstance(value, FlyteDirectory):
        return {"directory_sha256": directory_sha256(_local(value))}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, float):
        return repr(value)  # exact, and nan/inf as well
    if value is None or isinstance(value, (bool, int, str)):
        return value
    # Anything else has no canonical form here: a hash of its repr could collide or drift.
    raise TypeError(f"no content hash for a {type(value).__name__}: add it to flyscale/flyte/content.py")


def content_hash(value: Any) -> str:
    """The hash of a task output's content: its values, and its files' and directories' bytes."""
    return hashlib.sha256(json.dumps(_canonical(value), sort_keys=True).encode()).hexdigest()


# A task output `Annotated[T, BY_CONTENT]` enters the cache keys of the tasks after it by its content.
BY_CONTENT = HashMethod(content_hash)
