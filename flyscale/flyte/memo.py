"""Answers that depend only on their key, kept on disk from one process to the next.

Every `pyflyte run`, and every task pod as it starts, imports the workflow, and flytekit works
out each task's interface and cache version right then. That means parsing about 56 source files
for their imports (0.4 s) and building the JSON schemas of 32 dataclasses (0.3 s): the same
answers each time the code is unchanged, and most of what a cached run does that is flyscale's
own. The keys are content hashes, so an entry cannot go stale: changed code has a new key. It is
best effort: a folder that cannot be read or written, or an entry that does not decode, costs
the time again and never changes the answer.

The folder is `$FLYSCALE_CACHE_DIR`, else `$XDG_CACHE_HOME/flyscale`, else `~/.cache/flyscale`.
Deleting it is always safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flyscale import settings

T = TypeVar("T")
FORMAT = b"flyscale-memo-1"  # bump when what an entry holds changes shape


def folder() -> Path:
    if settings.CACHE_DIR.is_set():
        return Path(settings.CACHE_DIR.get())
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flyscale"


def key(*parts: str | bytes) -> str:
    """A hash of `parts` that no other sequence of parts shares (each is length-prefixed)."""
    digest = hashlib.sha256(FORMAT)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def remembered(
    kind: str, key: str, compute: Callable[[], T], encode: Callable[[T], bytes], decode: Callable[[bytes], T]
) -> T:
    """decode(the entry `kind`/`key`), or compute() and keep its encoding there."""
    path = folder() / kind / key
    with contextlib.suppress(OSError, ValueError):
        return decode(path.read_bytes())  # a corrupt entry raises ValueError (or a subclass): recomputed
    value = compute()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: a concurrent reader sees the whole entry or none.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".writing-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode(value))
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return value
