"""The registered model served without flyscale (flyscale/export/served.py): a classifier, a
regressor and a language model are saved as MLflow logs them, then loaded and asked in a fresh
virtualenv with nothing but each model's declared requirements (uv builds it from the package
index): no torch, no flyscale, no plugin. Their answers equal the PyTorch model's (greedy text
token for token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, ObjectiveConfig
from flyscale.data.text import ByteTokenizer
from flyscale.export import onnx
from flyscale.model import build_model, save_state
from flyscale.tracking import run_log, serving
from flyscale.tracking.model_spec import build, objective_of, spec_json
from tests.conftest import fresh_python

TOKENS = DatasetInfo(
    "tokens",
    0,
    [17],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [17], range=[0, 256])],
    input_field="tokens",
)
CASES = {
    "classifier": (DatasetInfo("t", 3, [4], list("abcd")), ModelConfig(options={"hidden": [8]}), None),
    "regressor": (
        DatasetInfo(
            "r",
            0,
            [4],
            [],
            label_column="y",
            fields=[FieldSpec("x", "float32", [4]), FieldSpec("y", "float32", [])],
            input_field="x",
        ),
        ModelConfig(options={"hidden": [8]}),
        ObjectiveConfig(name="regression"),
    ),
    "language model": (
        TOKENS,
        ModelConfig(name="gpt", options={"layers": 1, "heads": 2, "width": 32}),
        ObjectiveConfig(name="language_modeling", options={"max_new_tokens": 6, "temperature": 0.0}),
    ),
}
# Asked of the served model: what a user sends (rows of features; prompts) and its params.
ASKED = {
    "classifier": (np.random.default_rng(0).normal(size=(5, 4)).astype("float32").tolist(), None),
    "regressor": (np.random.default_rng(1).normal(size=(5, 4)).astype("float32").tolist(), None),
    "language model": (["Hello", "a", ""], {"max_new_tokens": 5, "temperature": 0.0}),
}
NOT_THERE = ("torch", "flyscale", "flyscale_plugins", "flytekit")

# Loads the model where none of NOT_THERE is installed, and prints its answer as JSON.
LOAD = f"""
import importlib.util, json, sys
assert not any(importlib.util.find_spec(m) for m in {NOT_THERE!r}), "the environment is not fresh"
import mlflow, numpy as np
asked, params = json.loads(sys.argv[2])
asked = asked if isinstance(asked[0], str) else np.asarray(asked, dtype="float32")
model = mlflow.pyfunc.load_model(sys.argv[1])
answer = model.predict(asked, params=params) if params else model.predict(asked)
print(json.dumps(answer.tolist() if hasattr(answer, "tolist") else answer))
"""


def _saved(case: str, tmp_path: Path) -> tuple[Path, run_log.ModelFiles]:
    info, model_cfg, objective_cfg = CASES[case]
    torch.manual_seed(0)
    model = build_model(model_cfg, info).eval()
    spec = spec_json(model_cfg, info, None, objective_cfg)
    tokenizer = ByteTokenizer().to_json() if info is TOKENS else ""
    objective, _ = objective_of(json.loads(spec), tokenizer)
    if info is TOKENS:
        x = torch.randint(0, 257, (4, 17))
    else:
        x = torch.randn(4, 4)
    path = onnx.export(model, onnx.model_inputs(x, torch.zeros(4, dtype=torch.long), objective), tmp_path / "m.onnx")
    files = run_log.ModelFiles(save_state(model, "m.pt"), spec, tokenizer, str(path))
    target = tmp_path / "model"
    mlflow.pyfunc.save_model(str(target), **run_log.model_args(files, "model", str(tmp_path)))
    return target, files


@pytest.mark.parametrize("case", CASES)
def test_the_registered_model_answers_as_pytorch_without_torch_or_flyscale(case, tmp_path, serving_envs):
    target, files = _saved(case, tmp_path)
    requirements = (target / "requirements.txt").read_text()
    assert "onnxruntime==" in requirements and "numpy==" in requirements
    assert not any(name in requirements for name in ("torch", "flyscale")), requirements
    asked, params = ASKED[case]
    python = fresh_python(target, serving_envs)
    proc = subprocess.run(
        [str(python), "-c", LOAD, str(target), json.dumps([asked, params])],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository, whose folders would be importable from here
        env={"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    spec = json.loads(files.spec_json)
    objective, context = objective_of(spec, files.tokenizer_json)
    want = serving.predict(objective, build(spec, files.weights_path), asked, params, context)
    if case == "language model":
        assert got == want and all(len(t) > 0 for t in got)  # greedy: the same tokens as torch
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
        assert np.asarray(got).shape == np.asarray(want).shape  # (5, 3) probabilities; (5,) values


def test_an_objective_with_its_own_predict_and_no_serving_keeps_the_pytorch_model(tmp_path):
    class Own:
        def predict(self, model, model_input, params, context):
            return np.zeros(1)

    assert onnx.serving(Own(), None) is None
    assert onnx.serving(object(), None) == {"output": "values", "scalar": False}  # raw outputs

    class Wrong:
        def serving(self, context):
            return {"output": "pixels"}

    with pytest.raises(onnx.ExportError, match="'pixels'.*one of"):
        onnx.serving(Wrong(), None)


class _Cummax(torch.nn.Module):
    """An operator ONNX lacks (cummax): torch.export traces it, the ONNX exporter cannot translate it."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.cummax(x, dim=1).values)


# Loads the model where flyscale cannot be imported (torch can: the program's declared runtime).
LOAD_WITHOUT_FLYSCALE = """
import importlib.abc, json, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flyscale", "flyscale_plugins", "flytekit"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NotInstalled())
import mlflow, numpy as np
print(json.dumps(mlflow.pyfunc.load_model(sys.argv[1]).predict(np.asarray(json.loads(sys.argv[2]), dtype="float32")).tolist()))
"""


def test_a_model_onnx_cannot_take_is_served_from_a_torch_export_program(tmp_path):
    info, model_cfg, _ = CASES["classifier"]
    torch.manual_seed(0)
    model = _Cummax().eval()
    x = torch.randn(4, 4)
    with pytest.raises(onnx.ExportError, match="could not be exported to ONNX"):
        onnx.export(model, x, tmp_path / "m.onnx")
    program = onnx.export_program(model, x, tmp_path / "m.pt2")
    split = [(torch.randn(16, 4), torch.zeros(16, dtype=torch.long)), (torch.randn(5, 4), torch.zeros(5))]
    parity = onnx.check_parity(model, program, split, None)  # any batch size: the batch is dynamic
    assert parity.examples == 21 and "the torch.export program against PyTorch" in parity.sentence()
    files = run_log.ModelFiles(save_state(model, "m.pt"), spec_json(model_cfg, info, None), "", "", str(program))
    target = tmp_path / "model"
    mlflow.pyfunc.save_model(str(target), **run_log.model_args(files, "model", str(tmp_path)))
    requirements = (target / "requirements.txt").read_text()
    assert "torch==" in requirements and "onnxruntime" not in requirements and "flyscale" not in requirements
    asked = np.random.default_rng(2).normal(size=(3, 4)).astype("float32")
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_FLYSCALE, str(target), json.dumps(asked.tolist())],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = torch.softmax(model(torch.from_numpy(asked)), dim=1).detach().numpy()
    np.testing.assert_allclose(np.asarray(json.loads(proc.stdout.strip().splitlines()[-1])), want, atol=1e-5)
