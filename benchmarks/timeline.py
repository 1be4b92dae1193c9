"""`pyflyte` with a stopwatch: where the seconds of one local run go.

    python -m benchmarks.timeline OUT.json run workflows/train.py training_pipeline [ARGS]

runs pyflyte's own command line in this process, timing (by wrapping flytekit's and flyscale's
functions for this process only; nothing in the project changes):

- import: from the interpreter's start until the workflow's first task runs (Python, the
  libraries, the workflow module, compiling the workflow);
- per task, its own work (`execute`), flytekit's conversion of its inputs and outputs
  (`dispatch_execute` minus `execute`) and the local cache's lookup and write (`local_execute`
  minus `dispatch_execute`);
- worker start-up: from the training task's start until every worker has joined the process group
  (forked workers inherit the wrapper, and write their times to a file);
- MLflow: the time inside flyscale's MLflow calls (reading the champion, the live run, publishing).

It writes them to OUT.json as seconds since the interpreter started, with the third-party
libraries and modules the run imported.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time

from flyscale.tracking.live import LiveRun

try:  # the interpreter's own start, when the OS tells (Linux: /proc); else now
    with open(f"/proc/{os.getpid()}/stat") as _f:
        _ticks = int(_f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as _f:
        _uptime = float(_f.read().split()[0])
    START = time.time() - (_uptime - _ticks / os.sysconf("SC_CLK_TCK"))
except (OSError, ValueError, IndexError):
    START = time.time()

EVENTS: list[dict] = []


def _now() -> float:
    return time.time() - START


def _timed(kind: str, name_of=lambda *a, **k: ""):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            began = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                EVENTS.append(
                    {"kind": kind, "name": name_of(*args, **kwargs), "start": began, "end": _now(), "pid": os.getpid()}
                )

        return inner

    return wrap


def _install(workers_file: str) -> None:
    from flytekit.core import base_task

    from flyscale.tracking import champion, champion_reference, live, log_and_register
    from flyscale.train import distributed

    dispatch = base_task.PythonTask.dispatch_execute

    def dispatch_execute(self, ctx, input_literal_map):
        name = self.name.rsplit(".", 1)[-1]
        self.execute = _timed("execute", lambda *a, **k: name)(type(self).execute.__get__(self))
        try:
            return _timed("dispatch", lambda *a, **k: name)(dispatch)(self, ctx, input_literal_map)
        finally:
            del self.execute

    base_task.PythonTask.dispatch_execute = dispatch_execute
    # local_execute: the local cache's lookup and write around dispatch_execute
    local = base_task.PythonTask.local_execute
    base_task.PythonTask.local_execute = lambda self, *a, **k: _timed(
        "local", lambda *_, **__: self.name.rsplit(".", 1)[-1]
    )(local)(self, *a, **k)
    # Patched where they are defined, before the tasks import them.
    for module, name in (
        (champion_reference, "read_reference"),
        (champion, "read_baseline"),
        (log_and_register, "publish"),
        (live, "close_failed_runs"),
    ):
        setattr(module, name, _timed("mlflow", lambda *a, _n=name, **k: _n)(getattr(module, name)))
    for name in ("__init__", "epoch"):
        setattr(LiveRun, name, _timed("mlflow", lambda *a, _n=name, **k: f"LiveRun.{_n}")(getattr(LiveRun, name)))

    joined = distributed.process_group

    @contextlib.contextmanager
    def process_group(*args, **kwargs):  # in a worker (forked: it inherits this wrapper)
        entered = _now()
        with joined(*args, **kwargs) as ctx:
            with open(workers_file, "a") as f:
                f.write(json.dumps({"rank": ctx.rank, "entered": entered, "joined": _now(), "pid": os.getpid()}) + "\n")
            yield ctx

    distributed.process_group = process_group


def third_party_modules() -> list[str]:
    """Every module loaded from site-packages (submodules too, such as the MLflow store that mlflow
    loads only when asked), in the order they were loaded; not this project's own."""
    ours = {"flyscale", "flyscale_plugins", "tasks", "workflows", "benchmarks"}
    return [
        name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] not in ours
        and not name.startswith("_")
        and "site-packages" in (getattr(module, "__file__", None) or "")
    ]


def top_level(modules: list[str]) -> list[str]:
    """The libraries of `modules`: top-level packages, or a namespace package's children
    (`flytekitplugins.kfpytorch`: `import flytekitplugins` alone loads nothing)."""

    def library(name: str) -> str:
        parts = name.split(".")
        namespace = getattr(sys.modules.get(parts[0]), "__file__", "") is None
        return ".".join(parts[:2] if namespace else parts[:1])

    return sorted({library(name) for name in modules})


def main(argv: list[str]) -> None:
    out, *pyflyte_args = argv
    workers_file = out + ".workers"
    with contextlib.suppress(FileNotFoundError):
        os.remove(workers_file)
    from flytekit.clis.sdk_in_container import pyflyte

    _install(workers_file)
    code = 0
    try:
        pyflyte.main(pyflyte_args, standalone_mode=False)
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        workers = []
        with contextlib.suppress(FileNotFoundError):
            workers = [json.loads(line) for line in open(workers_file)]
        end = _now()
        modules = third_party_modules()
        with open(out, "w") as f:
            json.dump(
                {"events": EVENTS, "workers": workers, "end": end, "modules": modules, "libraries": top_level(modules)},
                f,
            )
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
