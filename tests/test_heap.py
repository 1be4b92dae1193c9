"""A process that runs flyscale's stages freezes its heap (flyscale/flyte/heap.py): when the first
stage starts, before training workers are forked, and at exit, so that CPython's collector does
not walk what the imports built. Each case is a process of its own: what is frozen stays frozen."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

# Prints, as the process ends (after flyscale's own exit handler: atexit runs the last registered
# first, and this one is registered before flyscale is imported), how many objects are frozen.
AT_EXIT = """
import atexit, gc, os
atexit.register(lambda: os.write(1, f"frozen at exit {gc.get_freeze_count()}\\n".encode()))
"""


def _frozen(code: str) -> dict[str, int]:
    """{what: how many objects were frozen then}, from the `frozen <what> N` lines `code` prints."""
    done = subprocess.run([sys.executable, "-c", AT_EXIT + code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.rsplit(" ", 1) for line in done.stdout.splitlines() if line.startswith("frozen ")]
    return {what.removeprefix("frozen "): int(n) for what, n in lines}


def test_the_first_stage_freezes_what_is_alive_and_the_process_ends_frozen():
    frozen = _frozen("""
from typing import NamedTuple
from flyscale.flyte.provenance import UNSTAMPED, TaskRun, stamped

class Out(NamedTuple):
    value: int
    run: TaskRun = UNSTAMPED

@stamped
def stage(x: int) -> Out:
    return Out(x)

print("frozen before", gc.get_freeze_count())
stage(1)
print("frozen after", gc.get_freeze_count())
made_after = [[i] for i in range(10_000)]  # young objects, collected as usual until the exit
""")
    assert frozen["before"] == 0
    assert frozen["after"] > 10_000  # what the imports built
    assert frozen["at exit"] > frozen["after"] + 9_000  # and, at exit, the 10,001 lists made since


def test_a_process_that_only_loads_the_tasks_ends_frozen():
    """A run refused before any stage (a config error) still imported the tasks: it ends without
    the collector's walk too."""
    frozen = _frozen("import tasks.common\nprint('frozen loaded', gc.get_freeze_count())")
    assert frozen["loaded"] == 0 and frozen["at exit"] > 10_000


def test_the_driver_freezes_its_heap_before_forking_training_workers():
    frozen = _frozen("""
from flyscale.cluster import launchers
print("frozen before", gc.get_freeze_count())
launchers._preload_for_forked_workers()
print("frozen forking", gc.get_freeze_count())
""")
    assert frozen["before"] == 0 and frozen["forking"] > 10_000
