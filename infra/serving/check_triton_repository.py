"""Check a Triton model repository offline, as Triton would read it: each `config.pbtxt` parses
into Triton's ModelConfig protobuf (tritonclient's `model_config_pb2`), and what Triton checks
before loading holds (a model file in version 1, batching within max_batch_size, inputs and
outputs named as in the ONNX file).

    python infra/serving/check_triton_repository.py REPOSITORY

Runs with tritonclient and onnxruntime installed (the serving environment has both); imports nothing of
flyscale. Exit status 0 when every model passes; otherwise each problem is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path


def check_model(home: Path) -> list[str]:
    import onnxruntime as ort
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    problems = []
    try:
        config = text_format.Parse((home / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        return [f"{home.name}: config.pbtxt does not parse as Triton's ModelConfig: {exc}"]
    if config.name != home.name:
        problems.append(f"{home.name}: config name {config.name!r} is not the folder's")
    model = home / "1" / "model.onnx"
    if config.platform != "onnxruntime_onnx" or not model.is_file():
        problems.append(f"{home.name}: needs platform onnxruntime_onnx and 1/model.onnx")
        return problems
    if config.HasField("dynamic_batching"):
        if config.max_batch_size < 1:
            problems.append(f"{home.name}: dynamic_batching needs max_batch_size >= 1")
        late = [b for b in config.dynamic_batching.preferred_batch_size if b > config.max_batch_size]
        if late:
            problems.append(f"{home.name}: preferred batch sizes {late} exceed max_batch_size {config.max_batch_size}")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    expected = {
        "input": {i.name: i.shape for i in session.get_inputs()},
        "output": {o.name: o.shape for o in session.get_outputs()},
    }
    for kind, declared in (("input", config.input), ("output", config.output)):
        names = {t.name for t in declared}
        if names != set(expected[kind]):
            problems.append(f"{home.name}: {kind}s {sorted(names)} are not the ONNX file's {sorted(expected[kind])}")
            continue
        for t in declared:
            rank = len(expected[kind][t.name]) - (1 if config.max_batch_size > 0 else 0)
            if len(t.dims) != rank or any(d == 0 or d < -1 for d in t.dims):
                problems.append(f"{home.name}: {kind} {t.name!r} dims {list(t.dims)} do not fit the ONNX shape")
            if t.data_type == model_config_pb2.TYPE_INVALID:
                problems.append(f"{home.name}: {kind} {t.name!r} has no data type")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    repository = Path(argv[0])
    models = sorted(p for p in repository.iterdir() if (p / "config.pbtxt").exists())
    problems = [p for home in models for p in check_model(home)]
    for p in problems:
        print(p)
    if not models:
        print(f"{repository}: no model folder with a config.pbtxt")
        return 1
    print(f"{len(models)} model(s) checked: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
