"""Where a task writes the files it hands on (as a FlyteFile or FlyteDirectory).

On a cluster flytekit uploads each such file to the execution's bucket, so the task may write it
anywhere: a temporary folder of its pod. A local `pyflyte run` uploads nothing. The output, and
the entry Flyte's local cache keeps for it (~/.flyte/local-cache), name the very path the task
wrote; were that a temporary folder, a reboot or a tmp cleaner would delete the files while the
cache still names them, and the next run would take the cached entry and fail reading the next
task's inputs (flyteorg/flyte#6393). So in a local run they are written under one folder that
lasts as long as the cache does, ~/.flyscale/outputs, and `flyscale outputs --clear` empties the
two together.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path


def local_base() -> Path:
    """The folder a local run's outputs are written under (read at each call: HOME may differ)."""
    return Path.home() / ".flyscale" / "outputs"


def in_local_run() -> bool:
    """Whether this runs in a task of a local Flyte execution (`pyflyte run` without --remote),
    a training worker of one included."""
    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    return bool(state and state.is_local_execution())


def output_dir(prefix: str) -> Path:
    """A new, empty folder for files a task returns: under ~/.flyscale/outputs in a local run,
    and a temporary folder anywhere else (a cluster's pod, where flytekit uploads what the task
    returns; a test or a notebook that calls the code outside Flyte)."""
    base = None
    if in_local_run():
        base = local_base()
        base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def kept(path: str | Path, prefix: str) -> Path:
    """`path` (a file or a folder a plugin wrote where it chose) where a local run keeps its
    outputs: copied into a new `output_dir(prefix)` when it lies under the temporary folder, as it
    is. A file elsewhere is the plugin's or the user's, and stays where it is; copied, not moved,
    as something else may still read it."""
    path, where = Path(path), Path(path).resolve()
    temporary = where.is_relative_to(Path(tempfile.gettempdir()).resolve())
    if not in_local_run() or not temporary or where.is_relative_to(local_base().resolve()):
        return path
    target = output_dir(prefix) / path.name
    if path.is_dir():
        shutil.copytree(path, target)
    else:
        shutil.copy2(path, target)
    return target


def size() -> int:
    """The bytes of every file under the local outputs folder."""
    base = local_base()
    return sum(f.stat().st_size for f in base.rglob("*") if f.is_file()) if base.exists() else 0


def clear() -> int:
    """Empty Flyte's local cache and the local outputs folder together (the cache names files in
    the folder: either alone would leave the other pointing at nothing); returns the bytes deleted."""
    from flytekit.core.local_cache import LocalTaskCache

    LocalTaskCache.clear()
    deleted = size()
    shutil.rmtree(local_base(), ignore_errors=True)
    return deleted


def gone(error: str) -> str:
    """What to tell a user whose local run failed on `error` because a file it names under the
    outputs folder is gone (deleted while the cache still names it); "" for any other error."""
    base = str(local_base())
    # A path ends where the message's quoting does, or where flytekit's dump of the literal's
    # bytes goes on (octal escapes).
    named = re.findall(re.escape(base) + r"/[^\s'\"\\{},()]+", error)
    missing = sorted({p for p in named if not Path(p).exists()})
    if not missing:
        return ""
    return (
        f"a cached output of an earlier local run is gone: {missing[0]}"
        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        + f". Flyte's local cache still names files under {base} that were deleted. Run again with "
        "`pyflyte run --overwrite-cache ...` (every task runs anew), or `flyscale outputs --clear` "
        "to delete the rest with the cache."
    )
