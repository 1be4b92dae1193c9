"""`flyscale loadtest`: a registered version served on loopback, measured under load, in up to
three setups side by side in one run:

- `mlflow`: `mlflow models serve` (uv environment of the model's requirements), no batching;
- `mlserver`: MLServer with adaptive batching off (max_batch_size 1);
- `mlserver-batching`: MLServer with adaptive batching up to `max_batch_size` rows, waiting at
  most `max_delay_ms`.

Each setup runs the closed-loop levels of `loadtest.run`. The result is printed and logged to
MLflow as a run of its own in the version's experiment (a table, a plot, a metric per setup and
level, the replicas estimate), and the version gets the tag `flyscale.loadtest_run`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flyscale.serving import loadtest, servers
from flyscale.serving.repository import Batching, mlserver_repository

SETUPS = ("mlflow", "mlserver", "mlserver-batching")


@dataclass
class Target:
    """What a setup is asked to serve: the version, the model's files, one request's rows."""

    model_uri: str  # models:/NAME/VERSION
    name: str
    version: str
    model_dir: Path
    example: dict  # MLflow's serving input example (an /invocations body)

    def rows(self) -> np.ndarray | None:
        """One example row as float32 for the V2 protocol; None for a model that takes text."""
        given = self.example.get("inputs", self.example.get("instances"))
        try:
            rows = np.asarray(given, dtype="float32")
        except (TypeError, ValueError):
            return None
        return rows[:1] if rows.ndim >= 2 else None


def target(model_uri: str, name: str, version: str, download_to: Path) -> Target:
    """The registered version's files, downloaded."""
    import mlflow

    model_dir = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(download_to)))
    return local_target(model_dir, name, version, model_uri)


def local_target(model_dir: Path, name: str, version: str = "", model_uri: str = "") -> Target:
    """An MLflow model in a local folder (a candidate not registered yet, say)."""
    example_file = model_dir / "serving_input_example.json"
    if not example_file.exists():
        raise ValueError(
            f"{model_uri or model_dir} has no serving input example to send: it was not logged by flyscale"
        )
    return Target(model_uri or str(model_dir), name, version, model_dir, json.loads(example_file.read_text()))


@contextlib.contextmanager
def serve(setup: str, t: Target, batching: Batching, root: Path) -> Iterator[tuple[str, bytes, str]]:
    """The setup's server; yields (URL to POST to, one request's body, a description)."""
    if setup == "mlflow":
        one = (
            {**t.example, "inputs": t.example["inputs"][:1]} if isinstance(t.example.get("inputs"), list) else t.example
        )
        with servers.mlflow_serve(t.model_uri, root) as base:
            yield f"{base}/invocations", loadtest.mlflow_body(one), "mlflow models serve, no batching"
        return
    rows = t.rows()
    if rows is None:
        raise ValueError(f"{setup}: the model takes text; MLServer's batching is measured on tensor models only")
    used = batching if setup == "mlserver-batching" else Batching(max_batch_size=1, max_delay_ms=0)
    repo = mlserver_repository(t.model_dir, Path(tempfile.mkdtemp(prefix="flyscale-mlserver-")), t.name, used)
    with servers.mlserver(repo, root) as base:
        what = (
            f"MLServer, adaptive batching up to {used.max_batch_size} rows within {used.max_delay_ms:g} ms"
            if used.max_batch_size > 1
            else "MLServer, no batching"
        )
        yield f"{base}/v2/models/{t.name}/infer", loadtest.v2_body(rows), what


def run(
    t: Target, setups: Sequence[str], levels: Sequence[int], requests: int, batching: Batching, root: Path
) -> list[loadtest.LoadReport]:
    """Each setup's levels, one server at a time."""
    unknown = set(setups) - set(SETUPS)
    if unknown:
        raise ValueError(f"unknown setups {sorted(unknown)}; known: {list(SETUPS)}")
    reports = []
    for setup in setups:
        with serve(setup, t, batching, root) as (url, body, what):
            report = loadtest.run(what, url, body, levels, requests)
            report.setup = setup
            reports.append(report)
    return reports


def lines(reports: Sequence[loadtest.LoadReport], target_qps: float, p99_ms: float) -> list[str]:
    """The table and the replicas estimate, for a terminal."""
    out = [f"{'setup':<18} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'errors':>7}"]
    for r in reports:
        for lv in r.levels:
            out.append(
                f"{r.setup:<18} {lv.concurrency:>7} {lv.p50_ms:>8.2f} {lv.p99_ms:>8.2f} {lv.throughput:>8.1f} {lv.error_rate:>7.1%}"
            )
    for r in reports:
        n = r.replicas(target_qps, p99_ms)
        best = r.best_within(p99_ms)
        out.append(
            f"{r.setup}: {target_qps:g} req/s at p99 <= {p99_ms:g} ms needs {n} replica(s) "
            f"({best.throughput:.0f} req/s each at {best.concurrency} clients)"
            if n is not None and best is not None
            else f"{r.setup}: no level kept p99 within {p99_ms:g} ms without errors"
        )
    errors = [f"{r.setup} at {lv.concurrency}: {lv.first_error}" for r in reports for lv in r.levels if lv.errors]
    return out + [f"first error: {e}" for e in errors[:3]]


def figure(reports: Sequence[loadtest.LoadReport]):
    """p99 latency and throughput against concurrency, a line per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in reports:
        c = [lv.concurrency for lv in r.levels]
        left.plot(c, [lv.p99_ms for lv in r.levels], marker="o", label=r.setup)
        right.plot(c, [lv.throughput for lv in r.levels], marker="o", label=r.setup)
    for ax, label in ((left, "p99 latency (ms)"), (right, "throughput (requests/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def log(reports: Sequence[loadtest.LoadReport], t: Target, target_qps: float, p99_ms: float) -> str:
    """A run in the version's experiment with the table, the plot and the estimate; returns its id."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    version = client.get_model_version(t.name, t.version)
    experiment = client.get_run(version.run_id).info.experiment_id if version.run_id else None
    rows = [row for r in reports for row in r.rows()]
    with mlflow.start_run(experiment_id=experiment, run_name=f"loadtest-{t.name}-v{t.version}") as run:
        mlflow.set_tags({"flyscale.kind": "loadtest", "flyscale.model": t.name, "flyscale.model_version": t.version})
        mlflow.log_params(
            {"target_qps": target_qps, "p99_target_ms": p99_ms, "setups": ",".join(r.setup for r in reports)}
        )
        mlflow.log_table({k: [row[k] for row in rows] for k in rows[0]}, artifact_file="loadtest/levels.json")
        mlflow.log_figure(figure(reports), "loadtest/latency_throughput.png")
        for r in reports:
            mlflow.log_metrics(loadtest.scalars(r.levels, r.setup.replace("-", "_")))
            n = r.replicas(target_qps, p99_ms)
            if n is not None:
                mlflow.log_metric(f"{r.setup.replace('-', '_')}_replicas", n)
        mlflow.log_text("\n".join(lines(reports, target_qps, p99_ms)) + "\n", "loadtest/summary.txt")
    client.set_model_version_tag(t.name, t.version, "flyscale.loadtest_run", run.info.run_id)
    return run.info.run_id
