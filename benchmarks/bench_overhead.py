"""Where a local run's wall time goes, against the floor every `pyflyte run` pays.

The floor is `pyflyte run` of an empty workflow (one task that returns) in a file that imports
every third-party library the pipeline's run imported (torch, flytekit, mlflow, pandera,
matplotlib, scikit-learn, ...): Python, those imports and flytekit's local execution, none of
flyscale's own work. Against it, `pyflyte run workflows/train.py
training_pipeline` uncached (a fresh HOME: an empty local cache; an MLflow store that exists) and cached (the same command again).
Every run goes through benchmarks.timeline, which also breaks the uncached run down: import,
worker start-up, each task's own work, flytekit's conversions and local cache, MLflow.
Goals: uncached <= 4x the floor, cached <= 1.2x; medians of interleaved rounds. Measured against
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

from tests.conftest import mlflow_server_at  # the server the tests start, started the same way

REPO = Path(__file__).resolve().parents[1]
PIPELINE = ("workflows/train.py", "training_pipeline")
GOALS = {"uncached": 4.0, "cached": 1.2}


def _floor_workflow(folder: Path, libraries: list[str]) -> Path:
    imports = "\n".join(f"import {name}  # noqa: F401" for name in libraries)
    path = folder / "floor.py"
    path.write_text(f"{imports}\nfrom flytekit import task, workflow\n\n\n@task\ndef nothing() -> int:\n    return 0\n\n\n"
                    f"@workflow\ndef empty() -> int:\n    return nothing()\n")
    return path


def timed_run(out: Path, home: Path, store: str, *args: str) -> dict:
    # One matplotlib font cache for all runs: a user's is built once, not per fresh HOME.
    env = {**os.environ, "HOME": str(home), "MLFLOW_TRACKING_URI": store, "MPLCONFIGDIR": str(out.parent / "mpl")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.timeline", str(out), "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
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
    parts.append(("flytekit: inputs/outputs to literals", sum(
        dispatch[n]["end"] - dispatch[n]["start"] - (execute[n]["end"] - execute[n]["start"]) for n in execute)))
    parts.append(("flytekit: local cache, workflow between tasks", sum(
        local[n]["end"] - local[n]["start"] for n in local if n not in dispatch) + sum(
        local[n]["end"] - local[n]["start"] - (dispatch[n]["end"] - dispatch[n]["start"]) for n in dispatch)))
    accounted = sum(seconds for _, seconds in parts if seconds > 0)
    parts.append(("the rest (between tasks, summary, exit)", timeline["end"] - accounted))
    return parts


def _runs(root: Path, store: str, floor_file: Path, rounds: int = 3, home: Path | None = None) -> dict[str, list]:
    """Per round, interleaved so that drift of the machine hits all alike: the floor, the pipeline
    uncached (a fresh local cache; skipped when `home` is a cache filled already) and the
    pipeline again on that cache. Timelines, by kind."""
    out: dict[str, list] = {"floor": [], "uncached": [], "cached": []}
    for i in range(rounds):
        out["floor"].append(timed_run(root / f"f{i}.json", root / "home-floor", store, str(floor_file), "empty"))
        cache = home or root / f"home-{i}"
        if home is None:
            out["uncached"].append(timed_run(root / f"u{i}.json", cache, store, *PIPELINE))
        out["cached"].append(timed_run(root / f"c{i}.json", cache, store, *PIPELINE))
    return out


def _median(timelines: list[dict]) -> float:
    return statistics.median(t["end"] for t in timelines)


def _line(name: str, seconds: float, floor: float, goal: float) -> str:
    ratio = seconds / floor
    return (f"  {name:<28} {seconds:6.1f} s   floor {floor:5.1f} s   ratio {ratio:.2f} "
            f"(goal <= {goal}: {'met' if ratio <= goal else 'NOT met'})")


def main() -> None:
    print(f"bench_overhead: a local `pyflyte run` against an empty workflow's (goals: uncached <= {GOALS['uncached']}x, "
          f"cached <= {GOALS['cached']}x)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = f"sqlite:///{root / 'mlflow.db'}"
        # The store and the font cache exist already, as on a user's second run: creating MLflow's
        # tables (3-4 s) and matplotlib's font list are paid once per machine, not per run.
        subprocess.run([sys.executable, "-c", "import sys, matplotlib.font_manager, mlflow; "
                        "mlflow.MlflowClient(sys.argv[1]).search_experiments()", store],
                       env={**os.environ, "MPLCONFIGDIR": str(root / "mpl")}, check=True, capture_output=True)
        # Which libraries the floor imports: every one the pipeline's run imported.
        first = timed_run(root / "first.json", root / "home-first", store, *PIPELINE)
        floor_file = _floor_workflow(root, first["libraries"])
        runs = _runs(root, store, floor_file)
        floor = _median(runs["floor"])
        print(_line("uncached", _median(runs["uncached"]), floor, GOALS["uncached"]))
        print(_line("cached", _median(runs["cached"]), floor, GOALS["cached"]))
        # A cached run still reads the champion (never a stale decision). Against the default
        # SQLite store that loads MLflow's SQLAlchemy store in the run's process (about 1.7 s of
        # imports); against a tracking server, as a team runs it, the client speaks REST.
        server_root = root / "server"
        server_root.mkdir()
        with mlflow_server_at(server_root) as uri:
            timed_run(root / "fill.json", root / "home-server", uri, *PIPELINE)  # the cache the cached runs hit
            served = _runs(root, uri, floor_file, home=root / "home-server")
        print(_line("cached, MLflow server", _median(served["cached"]), _median(served["floor"]), GOALS["cached"]))
    # The breakdown of the median uncached run.
    uncached = sorted(runs["uncached"], key=lambda t: t["end"])[len(runs["uncached"]) // 2]
    print("  the uncached run, part by part:")
    for part, seconds in breakdown(uncached):
        print(f"    {part:<48} {abs(seconds):6.2f} s")


if __name__ == "__main__":
    main()
