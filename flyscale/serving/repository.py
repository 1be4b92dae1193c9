"""Model repositories for batching servers, made from a registered version.

- MLServer (Seldon's, with its MLflow runtime): `settings.json`, and `<name>/model-settings.json`
  beside the MLflow model itself (`<name>/model`). `max_batch_size` and `max_batch_time` turn
  on MLServer's adaptive batching: requests that arrive within `max_batch_time` of each other
  are run as one batch, up to `max_batch_size` rows.
- Triton Inference Server: `<name>/config.pbtxt` and `<name>/1/model.onnx`, for Triton's ONNX
  Runtime backend, with `dynamic_batching` (preferred sizes, queue delay) and `max_batch_size`.
  The inputs and outputs are read from the ONNX file: the batch dimension is Triton's, a
  dynamic one (a sequence) is -1.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

MLSERVER_RUNTIME = "mlserver_mlflow.MLflowRuntime"

# ONNX tensor element types (onnx.TensorProto) as Triton names them.
TRITON_TYPES = {
    1: "TYPE_FP32",
    2: "TYPE_UINT8",
    3: "TYPE_INT8",
    6: "TYPE_INT32",
    7: "TYPE_INT64",
    10: "TYPE_FP16",
    11: "TYPE_FP64",
}


@dataclass
class Batching:
    """How a server batches requests: up to `max_batch_size` rows, waiting at most `max_delay_ms`
    for more to arrive. `max_batch_size` 1 is no batching."""

    max_batch_size: int = 32
    max_delay_ms: float = 5.0

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_delay_ms < 0:
            raise ValueError(f"max_batch_size must be >= 1 and max_delay_ms >= 0, got {self}")

    def preferred(self) -> list[int]:
        """Triton's preferred batch sizes: powers of two from 4 up to the maximum, and it."""
        sizes = [2**k for k in range(2, 16) if 2**k < self.max_batch_size]
        return [*sizes[-3:], self.max_batch_size]


def mlserver_repository(model_dir: Path, out: Path, name: str, batching: Batching, http_port: int = 8080) -> Path:
    """An MLServer repository at `out` serving the MLflow model in `model_dir` as `name`."""
    out.mkdir(parents=True, exist_ok=True)
    # Inference in the server's own process (parallel_workers 0): MLServer 1.7's worker processes
    # fail to start under Python 3.11 with the uvloop it installs, and on a few cores one process
    # with ONNX Runtime's own threads is what serves best anyway.
    settings: dict = {"http_port": http_port, "grpc_port": 0, "metrics_port": 0, "debug": False, "parallel_workers": 0}
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    home = out / name
    if home.exists():
        shutil.rmtree(home)
    shutil.copytree(model_dir, home / "model")
    model_settings = {
        "name": name,
        "implementation": MLSERVER_RUNTIME,
        "parameters": {"uri": "./model"},
        "max_batch_size": batching.max_batch_size,
        "max_batch_time": batching.max_delay_ms / 1000,
    }
    (home / "model-settings.json").write_text(json.dumps(model_settings, indent=2) + "\n")
    return out


def _tensors(values) -> list[tuple[str, str, list[int]]]:
    """(name, Triton type, dims past the batch; -1 where dynamic) of ONNX graph inputs or outputs."""
    out = []
    for v in values:
        t = v.type.tensor_type
        kind = TRITON_TYPES.get(t.elem_type)
        if kind is None:
            raise ValueError(
                f"ONNX tensor {v.name!r} has element type {t.elem_type}, which this repository does not map"
            )
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim][1:]
        out.append((v.name, kind, dims))
    return out


def triton_config(onnx_path: Path, name: str, batching: Batching, instances: int = 1) -> str:
    """The config.pbtxt of `onnx_path` served as `name` by Triton's ONNX Runtime backend on CPU."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    initialisers = {i.name for i in graph.initializer}
    inputs = _tensors([i for i in graph.input if i.name not in initialisers])
    outputs = _tensors(graph.output)

    def block(kind: str, tensors) -> str:
        items = ",\n".join(
            f'  {{\n    name: "{n}"\n    data_type: {t}\n    dims: [ {", ".join(str(d) for d in dims)} ]\n  }}'
            for n, t, dims in tensors
        )
        return f"{kind} [\n{items}\n]"

    preferred = ", ".join(str(b) for b in batching.preferred())
    return "\n".join(
        [
            f'name: "{name}"',
            'platform: "onnxruntime_onnx"',
            f"max_batch_size: {batching.max_batch_size}",
            block("input", inputs),
            block("output", outputs),
            "dynamic_batching {",
            f"  preferred_batch_size: [ {preferred} ]",
            f"  max_queue_delay_microseconds: {round(batching.max_delay_ms * 1000)}",
            "}",
            f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]",
            "",
        ]
    )


def triton_repository(onnx_path: Path, out: Path, name: str, batching: Batching) -> Path:
    """A Triton model repository at `out`: `<name>/config.pbtxt` and `<name>/1/model.onnx`."""
    home = out / name
    (home / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(onnx_path, home / "1" / "model.onnx")
    (home / "config.pbtxt").write_text(triton_config(onnx_path, name, batching))
    return out
