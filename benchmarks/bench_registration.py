"""Logging a run's two models and its metrics to a real `mlflow server` on loopback, in the order
flyscale's registration uses (the models first, then the metrics, linked to them by
`model_log.link_metrics`) against MLflow's own order (the metrics, then `log_model`, which reads
back every metric's history to link the step-0 ones: one request a metric and a model).

A run of the quick preset logs about 100 metrics; the models here are a small pyfunc model from
code. Each log_model's own work (saving the model, inferring its requirements, checking its
input example) is the same in both orders and most of the time here; what differs is about 200
requests, each a round trip, so on a tracking server farther away than loopback the gap widens.
Goal: flyscale's order / MLflow's <= 0.8 on the paired median.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import interleaved, report
from flyscale.tracking.model_log import link_metrics
from tests.conftest import mlflow_server_at

GOAL = 0.8
METRICS = 100  # about what a quick run logs (its test metrics per class, latency, validation)
ROUNDS = 5
MODEL_CODE = """
import mlflow.pyfunc
from mlflow.models import set_model


class Echo(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input):
        return model_input


set_model(Echo())
"""


def _log(order: str, code: Path) -> list[float]:
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient()
    start = time.perf_counter()
    with mlflow.start_run() as run:
        now = int(time.time() * 1000)
        metrics = [Metric(f"test_metric_{i}", float(i), now, 0) for i in range(METRICS)]
        if order == "mlflow's":
            client.log_batch(run.info.run_id, metrics=metrics)
        infos = [mlflow.pyfunc.log_model(name=name, python_model=str(code)) for name in ("model", "model_int8")]
        if order == "flyscale's":
            client.log_batch(run.info.run_id, metrics=metrics)
            link_metrics(client, run.info.run_id, metrics, [info.model_id for info in infos])
    return [time.perf_counter() - start]


def main() -> None:
    import mlflow

    with tempfile.TemporaryDirectory() as tmp, mlflow_server_at(Path(tmp)) as uri:
        code = Path(tmp) / "echo.py"
        code.write_text(MODEL_CODE)
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("bench-registration")
        _log("mlflow's", code)  # warm: imports, the experiment, the server's first requests
        times = interleaved({order: lambda o=order: _log(o, code) for order in ("mlflow's", "flyscale's")}, ROUNDS)
    report(
        f"registration: {METRICS} metrics and two models logged to a real mlflow server on loopback (s/run)",
        "mlflow's",
        ["flyscale's"],
        {"two models": times},
        GOAL,
        judge="paired",
    )


if __name__ == "__main__":
    main()
