"""The Python heap of a process that runs flyscale's stages: `pyflyte run`, a task's container, a
training worker forked from either, a `flyscale` command.

Such a process imports torch, flytekit, MLflow, pandas and ONNX: a few hundred thousand objects
that live until it ends. CPython's cycle collector walks every one of them at each full collection,
and several times more while the interpreter shuts down, to find garbage that is not there: at
exit alone that is seconds of a small local run. `gc.freeze()` moves the objects alive at that
moment out of the collector's view (they are still freed by reference counting); what is made
after is collected as usual.

The same freeze is what Python's documentation asks of a parent that forks without exec: a forked
training worker's collections then walk only its own objects, and leave the pages it shares with
the driver unwritten.
"""

from __future__ import annotations

import atexit
import functools
import gc


@functools.cache
def end_without_collecting() -> None:
    """At exit, freeze the heap instead of collecting it: the operating system takes it back
    anyway. (Registered once per process; what closes files and flushes logs at exit is an
    `atexit` handler of its own, or reference counting, neither of which this stops.)"""
    atexit.register(gc.freeze)


@functools.cache
def settle() -> None:
    """When a stage starts: freeze what is alive (the imports are done by then), once per process."""
    gc.freeze()
    end_without_collecting()


def before_fork() -> None:
    """Freeze what is alive before training workers are forked, as Python's documentation asks,
    so that no worker's collector walks (and so copies) the driver's objects. A cycle the driver
    dropped and has not collected yet stays until exit: collecting it first would walk the whole
    heap, which is what this avoids."""
    gc.freeze()
