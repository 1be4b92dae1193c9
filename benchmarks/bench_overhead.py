"""Where a local run's wall time goes, against the floor every `pyflyte run` pays.

The floor is `pyflyte run` of an empty workflow (one task that returns) in a file that imports
every third-party module the pipeline's run imported, in the order it did: Python, the libraries'
imports and flytekit's local execution, none of flyscale's own work. Every module, not only the
top-level packages: mlflow loads its SQLAlchemy store only when a store is opened (0.4 s), and the
Kubeflow plugin sits in a namespace package (`import flytekitplugins` loads nothing); a floor of
top-level imports leaves those out and is printed beside it, so the difference shows.
Against it, `pyflyte run workflows/train.py training_pipeline` uncached (a fresh HOME: an empty
local cache; an MLflow store that exists) and cached (the same command again).
Every run goes through benchmarks.timeline, which also breaks the uncached run down: import,
worker start-up, each task's own work, flytekit's conversions and local cache, MLflow.
Goals: uncached <= 4x the floor, cached <= 1.2x; the median ratio of 5 interleaved rounds. Measured against
the default SQLite store, and against a real `mlflow server` on loopback (see main()).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import (
    mlflow_server_at,  # the server the tests start, started the same way
)

REPO = Path(__file__).resolve().parents[1]
PIPELINE = ("workflows/train.py", "training_pipeline")
GOALS = {"uncached": 4.0, "cached": 1.2}


def _floor_workflow(path: Path, modules: list[str]) -> Path:
    """An empty workflow in `path` that first imports `modules` in order (one that cannot be
    imported on its own is skipped, and counted in the file beside it)."""
    path.write_text(f"""import importlib
import json

failed = []
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name)
with open({str(path.with_suffix(".failed.json"))!r}, "w") as f:
    json.dump(failed, f)

from flytekit import task, workflow  # noqa: E402


@task
def nothing() -> int:
    return 0


@workflow
def empty() -> int:
    return nothing()
""")
    return path


def timed_run(out: Path, home: Path, store: str, *args: str) -> dict:
    # One matplotlib font cache for all runs: a user's is built once, not per fresh HOME.
    env = {**os.environ, "HOME": str(home), "MLFLOW_TRACKING_URI": store, "MPLCONFIGDIR": str(out.parent / "mpl")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.timeline", str(out), "run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pyflyte run {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def breakdown(timeline: dict) -> list[tuple[str, float]]:
    """(part, seconds) of one run, in the order they happen; they add up to its wall time."""
    events = timeline["events"]
    by = lambda kind: {e["name"]: e for e in events if e["kind"] == kind}  # noqa: E731
    local, dispatch, execute = by("local"), by("dispatch"), by("execute")
    first = min(e["start"] for e in local.values())
    parts = [("interpreter, imports, workflow compile", first)]
    train = execute.get("train_model")
    startup = 0.0
    if train and timeline["workers"]:
        startup = max(w["joined"] for w in timeline["workers"]) - train["start"]
        parts.append(("training workers' start-up", startup))
    for name, e in sorted(execute.items(), key=lambda kv: kv[1]["start"]):
        own = e["end"] - e["start"] - (startup if name == "train_model" else 0.0)
        parts.append((f"task {name}", own))
    mlflow = sum(e["end"] - e["start"] for e in events if e["kind"] == "mlflow")
    parts.append(("  of which MLflow calls (in the tasks above)", -mlflow))  # shown, not added twice
    parts.append(
        (
            "flytekit: inputs/outputs to literals",
            sum(dispatch[n]["end"] - dispatch[n]["start"] - (execute[n]["end"] - execute[n]["start"]) for n in execute),
        )
    )
    parts.append(
        (
            "flytekit: local cache, workflow between tasks",
            sum(local[n]["end"] - local[n]["start"] for n in local if n not in dispatch)
            + sum(local[n]["end"] - local[n]["start"] - (dispatch[n]["end"] - dispatch[n]["start"]) for n in dispatch),
        )
    )
    accounted = sum(seconds for _, seconds in parts if seconds > 0)
    parts.append(("the rest (between tasks, summary, exit)", timeline["end"] - accounted))
    return parts


def _runs(
    root: Path, store: str, floors: dict[str, Path], rounds: int = 5, home: Path | None = None
) -> dict[str, list]:
    """Per round, interleaved so that drift of the machine hits all alike: each floor, the pipeline
    uncached (a fresh local cache; skipped when `home` is a cache filled already) and the
    pipeline again on that cache. Timelines, by kind ("uncached", "cached", "floor <name>")."""
    out: dict[str, list] = {"uncached": [], "cached": [], **{f"floor {name}": [] for name in floors}}
    for i in range(rounds):
        for name, floor_file in floors.items():
            out[f"floor {name}"].append(
                timed_run(root / f"f-{name}-{i}.json", root / "home-floor", store, str(floor_file), "empty")
            )
        cache = home or root / f"home-{i}"
        if home is None:
            out["uncached"].append(timed_run(root / f"u{i}.json", cache, store, *PIPELINE))
        out["cached"].append(timed_run(root / f"c{i}.json", cache, store, *PIPELINE))
    return out


def _line(name: str, runs: list[dict], floors: list[dict], goal: float | None) -> str:
    """The median of the rounds' ratios, each run against the floor of its own round (drift of the
    machine between rounds cancels), with that round's seconds and every round's ratio."""
    rounds = sorted((run["end"] / floor["end"], run["end"], floor["end"]) for run, floor in zip(runs, floors))
    ratio, seconds, floor = rounds[len(rounds) // 2]
    judged = f"(goal <= {goal}: {'met' if ratio <= goal else 'NOT met'})" if goal else "(shown, not judged)"
    return (
        f"  {name:<40} {seconds:6.1f} s   floor {floor:5.1f} s   ratio {ratio:.2f} {judged}   "
        f"rounds: {' '.join(f'{r:.2f}' for r, _, _ in rounds)}"
    )


def _floors(root: Path, store: str, home: Path, tag: str, uncached: bool = True) -> dict[str, Path]:
    """The floor files for runs like these: the modules an uncached and a cached run on `home`
    imported (a cached run imports less: no training, no plots), and the top-level libraries."""
    floors = {}
    if uncached:
        first = timed_run(root / f"first-{tag}.json", home, store, *PIPELINE)
        floors["uncached"] = _floor_workflow(root / f"floor-{tag}-uncached.py", first["modules"])
    again = timed_run(root / f"again-{tag}.json", home, store, *PIPELINE)
    floors["cached"] = _floor_workflow(root / f"floor-{tag}-cached.py", again["modules"])
    floors["top-level"] = _floor_workflow(root / f"floor-{tag}-top.py", again["libraries"])
    return floors


def _skipped(floors: dict[str, Path]) -> str:
    failed = sorted(
        {name for path in floors.values() for name in json.loads(path.with_suffix(".failed.json").read_text())}
    )
    return (
        f"  (the floors skipped {len(failed)} modules that do not import on their own: {failed[:5]})" if failed else ""
    )


def main() -> None:
    print(
        f"bench_overhead: a local `pyflyte run` against an empty workflow's (goals: uncached <= {GOALS['uncached']}x, "
        f"cached <= {GOALS['cached']}x)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = f"sqlite:///{root / 'mlflow.db'}"
        # The store and the font cache exist already, as on a user's second run: creating MLflow's
        # tables (3-4 s) and matplotlib's font list are paid once per machine, not per run.
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, matplotlib.font_manager, mlflow; mlflow.MlflowClient(sys.argv[1]).search_experiments()",
                store,
            ],
            env={**os.environ, "MPLCONFIGDIR": str(root / "mpl")},
            check=True,
            capture_output=True,
        )
        floors = _floors(root, store, root / "home-first", "sqlite")
        runs = _runs(root, store, floors)
        for kind in ("uncached", "cached"):
            print(_line(kind, runs[kind], runs[f"floor {kind}"], GOALS[kind]))
        print(_line("cached, floor of top-level imports only", runs["cached"], runs["floor top-level"], None))
        lazy = statistics.median(f["end"] - t["end"] for f, t in zip(runs["floor cached"], runs["floor top-level"]))
        print(
            f"  the library modules loaded lazily (MLflow's SQLAlchemy store, the Kubeflow plugin, ...) cost "
            f"{lazy:.1f} s of the cached run's floor"
        )
        # A cached run still reads the champion (never a stale decision). Against the default
        # SQLite store that loads MLflow's SQLAlchemy store in the run's process; against a
        # tracking server, as a team runs it, the client speaks REST.
        server_root = root / "server"
        server_root.mkdir()
        with mlflow_server_at(server_root) as uri:
            timed_run(root / "fill.json", root / "home-server", uri, *PIPELINE)  # the cache the cached runs hit
            served_floors = {"cached": _floors(root, uri, root / "home-server", "server", uncached=False)["cached"]}
            served = _runs(root, uri, served_floors, home=root / "home-server")
        print(_line("cached, MLflow server", served["cached"], served["floor cached"], GOALS["cached"]))
        if skipped := _skipped({**floors, **served_floors}):
            print(skipped)
    # The breakdown of the median uncached run.
    uncached = sorted(runs["uncached"], key=lambda t: t["end"])[len(runs["uncached"]) // 2]
    print("  the uncached run, part by part:")
    for part, seconds in breakdown(uncached):
        print(f"    {part:<48} {abs(seconds):6.2f} s")


if __name__ == "__main__":
    main()
