"""Batching under load: MLServer with adaptive batching against MLServer without, the same
model saved as flyscale registers it (ONNX-served), 64 closed-loop clients of one-row requests
on loopback (flyscale/serving/loadtest.py). Goal: batching >= 3x the throughput, with p99 no
worse than 2x.

Three models: the default MLP, whose inference (tens of microseconds) is small beside a request's
HTTP and JSON handling, so batching has little to save; and wide MLPs (two 2048- or 4096-wide
layers), where reading the weights dominates a one-row call and a batch of rows costs little
more than one row. The
clients run on the same cores as the server, so the absolute numbers are the pair's.

Needs uv and the package index: the server runs in an environment of its own
(~/.cache/flyscale/serving), built on first use.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import numpy as np
import torch

from flyscale.api import DatasetInfo
from flyscale.config import ModelConfig
from flyscale.export import onnx
from flyscale.model import build_model, save_state
from flyscale.serving import loadtest, servers
from flyscale.serving.repository import Batching, mlserver_repository
from flyscale.tracking import model_log
from flyscale.tracking.model_spec import spec_json

CLIENTS = 64
REQUESTS = 1280  # 20 a client
BATCHING = Batching(max_batch_size=64, max_delay_ms=5)
GOAL_THROUGHPUT, GOAL_P99 = 3.0, 2.0
INFO = DatasetInfo("digits", 10, [64], [f"p{i}" for i in range(64)])
MODELS = {
    "mlp (default)": ModelConfig(),
    "wide mlp (2048 x 2)": ModelConfig(options={"hidden": [2048, 2048]}),
    "wider mlp (4096 x 2)": ModelConfig(options={"hidden": [4096, 4096]}),
}
ENVS = Path("~/.cache/flyscale/serving").expanduser()


def _saved(cfg: ModelConfig, tmp: Path) -> Path:
    torch.manual_seed(0)
    model = build_model(cfg, INFO).eval()
    path = onnx.export(model, torch.randn(4, 64), tmp / "model.onnx")
    files = model_log.ModelFiles(save_state(model, "m.pt"), spec_json(cfg, INFO, None), "", str(path))
    target = tmp / "mlflow-model"
    mlflow.pyfunc.save_model(str(target), **model_log.model_args(files, "model", str(tmp)))
    return target


def _measure(model_dir: Path, batching: Batching, tmp: Path) -> tuple[loadtest.Level, loadtest.Level]:
    repo = mlserver_repository(model_dir, tmp / f"repo-{batching.max_batch_size}", "m", batching)
    body = loadtest.v2_body(np.random.default_rng(0).normal(size=(1, 64)))
    with servers.mlserver(repo, ENVS) as base:
        url = f"{base}/v2/models/m/infer"
        loadtest.run_level(url, body, 4, 100)  # warm
        return loadtest.run_level(url, body, 1, 200), loadtest.run_level(url, body, CLIENTS, REQUESTS)


def main() -> None:
    print(
        f"bench_serving: MLServer, adaptive batching (up to {BATCHING.max_batch_size} rows within "
        f"{BATCHING.max_delay_ms:g} ms) against none; {CLIENTS} closed-loop clients, {REQUESTS} one-row requests"
    )
    for label, cfg in MODELS.items():
        tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
        model_dir = _saved(cfg, tmp)
        alone1, alone = _measure(model_dir, Batching(max_batch_size=1, max_delay_ms=0), tmp)
        batched1, batched = _measure(model_dir, BATCHING, tmp)
        ratio, p99 = batched.throughput / alone.throughput, batched.p99_ms / alone.p99_ms
        print(f"  {label}")
        for name, one, many in (("no batching", alone1, alone), ("batching", batched1, batched)):
            print(
                f"    {name:<12} 1 client: p50 {one.p50_ms:6.2f} ms   {CLIENTS} clients: {many.throughput:7.1f} req/s, "
                f"p50 {many.p50_ms:7.2f} ms, p99 {many.p99_ms:7.2f} ms, errors {many.errors}"
            )
        met = ratio >= GOAL_THROUGHPUT and p99 <= GOAL_P99
        print(
            f"    batching at {CLIENTS} clients: {ratio:.2f}x the throughput (goal >= {GOAL_THROUGHPUT}x), "
            f"p99 {p99:.2f}x (goal <= {GOAL_P99}x): {'met' if met else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
