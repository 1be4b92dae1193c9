"""`pyflyte run workflows/predict.py batch_predict` over a sharded Parquet dataset: one
prediction per input row (a row with a missing feature value included, an empty file too), the
version that scored it on every row, the pieces scored as map tasks; a file whose feature is not
a number fails naming the column, the row and the file. Typed examples too: PNG images in shards,
decoded and scaled as training reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import load_digits

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig
from tests.conftest import run_pipeline
from tests.registered import register

pytestmark = pytest.mark.timeout(600)

MODEL = "predict-e2e"
COLUMNS = [f"pixel_{i}" for i in range(64)]
PREDICT = ("workflows/predict.py", "batch_predict")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return register(tmp_path_factory.mktemp("store"), MODEL)


def _predict(tmp_path: Path, uri: str, path: Path, model: str = MODEL, data: dict | None = None) -> tuple:
    given = json.dumps(data or {"dataset": "parquet", "options": {"path": str(path)}})
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return run_pipeline(
        home, "--model", model, "--data", given, env={"MLFLOW_TRACKING_URI": uri}, target=PREDICT, timeout=500
    )


def _output(stdout: str) -> tuple[pd.DataFrame, int, int, str]:
    out = re.search(r"Predictions\(dir=(\S+), rows=(\d+), files=(\d+), model_uri='([^']+)'\)", stdout)
    assert out, stdout[-2000:]
    frame = pd.concat([pd.read_parquet(p) for p in sorted(Path(out.group(1)).glob("part-*.parquet"))])
    return frame, int(out.group(2)), int(out.group(3)), out.group(4)


def test_batch_predict_writes_one_prediction_per_row_with_the_version(store, tmp_path):
    x = load_digits().data[:250].astype("float64")
    x[7, 3] = np.nan  # a missing value is scored (NaN in, NaN scores out), never dropped
    data = tmp_path / "to-score"
    data.mkdir()
    for k, (a, b) in enumerate([(0, 100), (100, 240), (240, 250), (250, 250)]):  # the last file is empty
        pd.DataFrame(x[a:b], columns=COLUMNS).to_parquet(data / f"part-{k}.parquet")
    proc = _predict(tmp_path, store, data)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    frame, rows, files, version = _output(proc.stdout)
    assert (rows, files, version) == (250, 4, f"models:/{MODEL}/1")
    keys = list(zip(frame["_source_file"].map(lambda f: Path(f).name), frame["_source_row"]))
    want = [(f"part-{k}.parquet", r) for k, n in enumerate([100, 140, 10]) for r in range(n)]
    assert keys == want  # every row, in order, each once
    assert set(frame["model"]) == {f"models:/{MODEL}/1"}
    scores = np.stack(frame["scores"].to_numpy())
    finite = ~np.isnan(scores).any(axis=1)
    assert finite.sum() == 249 and np.allclose(scores[finite].sum(axis=1), 1, atol=1e-5)
    assert (frame["prediction"].to_numpy() == scores.argmax(axis=1)).all()


def test_a_feature_that_is_not_a_number_fails_naming_the_column_row_and_file(store, tmp_path):
    data = tmp_path / "bad"
    data.mkdir()
    frame = pd.DataFrame(load_digits().data[:20], columns=COLUMNS).astype(object)
    frame.loc[13, "pixel_5"] = "n/a"
    frame.astype(str).to_parquet(data / "part-0.parquet")
    proc = _predict(tmp_path, store, data)
    assert proc.returncode != 0
    assert "column 'pixel_5' at row 13 is not a number: 'n/a'" in proc.stdout + proc.stderr
    assert "part-0.parquet" in proc.stdout + proc.stderr


def test_batch_predict_scores_sharded_png_images(tmp_path):
    info = DatasetInfo(
        "shapes",
        4,
        [3, 8, 8],
        [],
        fields=[FieldSpec("image", "uint8", [3, 8, 8], range=[0, 255]), FieldSpec("label", "int64", [])],
        input_field="image",
    )
    uri = register(tmp_path, "images-e2e", info, ModelConfig(name="cnn", options={"channels": [8], "hidden": 16}))
    shapes = {"dataset": "shapes", "options": {"rows": 50, "size": 8, "encoding": "png", "chunk_rows": 20}}
    proc = _predict(tmp_path, uri, tmp_path, model="images-e2e", data=shapes)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    frame, rows, files, version = _output(proc.stdout)
    assert (rows, files, version) == (50, 3, "models:/images-e2e/1")  # a map task a shard: 20, 20, 10
    assert len(set(zip(frame["_source_file"], frame["_source_row"]))) == 50
    scores = np.stack(frame["scores"].to_numpy())
    assert scores.shape == (50, 4) and np.allclose(scores.sum(axis=1), 1, atol=1e-5)
    # The first shard's images, made again, scaled as training reads them (pixel / 255) and run
    # through the registered ONNX file: the same scores (PNG is lossless).
    import onnxruntime as ort

    from flyscale_plugins.images import ShapesOptions, generate

    images, _ = generate(20, ShapesOptions(**shapes["options"]), chunk=0)
    logits = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"input": images.astype("float32") / 255})[0]
    want = np.exp(logits - logits.max(1, keepdims=True))
    first = (frame["_source_file"] == frame["_source_file"].iloc[0]).to_numpy()
    np.testing.assert_allclose(scores[first], want / want.sum(1, keepdims=True), atol=1e-5)


# A python_model whose unpickling creates the file named by FLYSCALE_TEST_MARKER, logged as MLflow
# pickles a python_model (cloudpickle): what batch prediction must refuse before it loads anything.
PICKLED = """
import builtins, os, sys
import mlflow
from mlflow.pyfunc import PythonModel

class Planted(PythonModel):
    def __reduce__(self):
        return (builtins.open, (os.environ["FLYSCALE_TEST_MARKER"], "w"))

    def predict(self, context, model_input, params=None):
        return model_input

mlflow.set_tracking_uri(sys.argv[1])
with mlflow.start_run():
    info = mlflow.pyfunc.log_model(name="model", python_model=Planted())
print(mlflow.register_model(info.model_uri, "pickled").version)
"""


def test_batch_prediction_refuses_a_pickled_model_before_unpickling_it(store, tmp_path):
    import os
    import subprocess
    import sys

    import mlflow

    from flyscale.serving import batch

    mlflow.set_tracking_uri(store)  # another test may have moved MLflow's global URI since
    marker = tmp_path / "unpickled"
    env = {**os.environ, "FLYSCALE_TEST_MARKER": str(marker)}
    made = subprocess.run(
        [sys.executable, "-c", PICKLED, store], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr[-3000:]
    marker.unlink(missing_ok=True)  # MLflow loads what it logged, once, to check it
    with pytest.raises(batch.BatchPredictError) as refused:
        batch.load("models:/pickled/1", tmp_path / "model")
    said = str(refused.value)
    assert said.startswith("models:/pickled/1 is not a model flyscale registered (flavours ['python_function'], ")
    assert "python_model python_model.pkl" in said and "never unpickles" in said
    assert not marker.exists()
    # What it refused is live: MLflow's own loader runs the planted pickle.
    loads = "import mlflow, sys; mlflow.set_tracking_uri(sys.argv[1]); mlflow.pyfunc.load_model('models:/pickled/1')"
    subprocess.run([sys.executable, "-c", loads, store], env=env, cwd=tmp_path, capture_output=True, timeout=120)
    assert marker.exists()


def test_batch_prediction_runs_the_versions_onnx_file_with_flyscales_code_a_request_at_a_time(store, tmp_path):
    """The version's data files, run by this flyscale's served model, never its code file; more
    rows than one request may send are scored a request at a time, in order."""
    import mlflow
    import onnxruntime as ort

    from flyscale.serving import batch

    mlflow.set_tracking_uri(store)  # another test may have moved MLflow's global URI since
    model, info = batch.load(f"models:/{MODEL}/1", tmp_path / "model")
    assert info.feature_columns == COLUMNS and model.limits["max_rows"] == 1024
    model.limits["max_rows"] = 16
    x = load_digits().data[:40].astype("float32")
    x[20, 0] = np.nan
    got = batch._answers(model, x)
    (onnx_file,) = (tmp_path / "model").rglob("*.onnx")
    logits = ort.InferenceSession(str(onnx_file)).run(None, {"input": x})[0]
    want = np.exp(logits - logits.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    assert np.isnan(got[20]).all()
    np.testing.assert_allclose(np.delete(got, 20, axis=0), np.delete(want, 20, axis=0), atol=1e-5)
