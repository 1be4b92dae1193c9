"""The registered model served without flyscale (flyscale/export/onnx_pyfunc/): a classifier, a
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
import pyarrow.parquet as pq
import pytest
import torch

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, ObjectiveConfig
from flyscale.data.text import ByteTokenizer
from flyscale.export import onnx
from flyscale.model import build_model, save_state
from flyscale.tracking import model_io, model_log
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


def _saved(case: str, tmp_path: Path, limits: dict | None = None) -> tuple[Path, model_log.ModelFiles]:
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
    files = model_log.ModelFiles(save_state(model, "m.pt"), spec, tokenizer, str(path), limits=limits or {})
    target = tmp_path / "model"
    mlflow.pyfunc.save_model(str(target), **model_log.model_args(files, "model", str(tmp_path)))
    return target, files


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
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
    want = model_io.predict(objective, build(spec, files.weights_path), asked, params, context)
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


# Builds a torch.export program as torch.export.save writes it, with its sample inputs replaced by a
# pickle whose loading creates the file argv[2]: what torch.export.load unpickles when its
# weights_only load of them fails (torch/_export/serde/serialize.py, deserialize_torch_artifact).
PLANTED_PROGRAM = """
import builtins, pickle, sys, zipfile, torch
class Opens:
    def __reduce__(self):
        return (builtins.open, (sys.argv[2], "w"))
torch.export.save(torch.export.export(torch.nn.Linear(4, 3), (torch.randn(2, 4),)), sys.argv[1] + ".tmp")
with zipfile.ZipFile(sys.argv[1] + ".tmp") as src, zipfile.ZipFile(sys.argv[1], "w") as out:
    for info in src.infolist():
        planted = info.filename.endswith("data/sample_inputs/model.pt")
        out.writestr(info, pickle.dumps(Opens()) if planted else src.read(info))
"""
TORCH_LOADS = "import sys, torch\ntry:\n    torch.export.load(sys.argv[1])\nexcept Exception:\n    pass\n"


@pytest.mark.slow
def test_a_version_served_from_a_torch_export_program_is_refused_before_anything_is_unpickled(tmp_path):
    """An older flyscale registered a model ONNX could not take as a .pt2 program; loading one
    would run the pickle planted in it. The served model refuses it, naming why, and nothing runs."""
    from flyscale.export import onnx_pyfunc

    program, marker = tmp_path / "model.pt2", tmp_path / "unpickled"
    subprocess.run([sys.executable, "-c", PLANTED_PROGRAM, str(program), str(marker)], check=True, cwd=tmp_path)
    assert not marker.exists()
    serving_json = tmp_path / "serving.json"
    serving_json.write_text(json.dumps({"output": "probabilities", "input": {"dtype": "float32", "shape": [4]}}))
    target = tmp_path / "model"
    mlflow.pyfunc.save_model(
        str(target),
        python_model=onnx_pyfunc.PYTHON_MODEL,
        artifacts={"program": str(program), "serving": str(serving_json)},
    )
    with pytest.raises(Exception, match=r"model.pt2: the served model loads an ONNX file only.*may unpickle"):
        mlflow.pyfunc.load_model(str(target))
    assert not marker.exists()
    # What it refused is live: torch.export.load itself runs the planted pickle.
    subprocess.run([sys.executable, "-c", TORCH_LOADS, str(program)], cwd=tmp_path, capture_output=True, check=True)
    assert marker.exists()


# --- what the served model takes: what a caller has, checked, decoded and scaled as training did ---


def _image_model(tmp_path: Path):
    """A CNN on the shapes dataset's 3x8x8 PNG images, saved as registration logs it; (the loaded
    model, the dataset info, the ONNX file)."""
    from flyscale_plugins.images import Shapes, ShapesOptions

    info = Shapes().info(ShapesOptions(size=8, encoding="png"))
    model_cfg = ModelConfig(name="cnn", options={"channels": [8], "hidden": 16})
    torch.manual_seed(0)
    model = build_model(model_cfg, info).eval()
    path = onnx.export(model, torch.rand(4, 3, 8, 8), tmp_path / "m.onnx")
    files = model_log.ModelFiles(save_state(model, "m.pt"), spec_json(model_cfg, info, None), "", str(path))
    mlflow.pyfunc.save_model(str(tmp_path / "model"), **model_log.model_args(files, "model", str(tmp_path)))
    return mlflow.pyfunc.load_model(str(tmp_path / "model")), info, path


def _probabilities(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    logits = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _ask(model, body: str) -> tuple[int, dict]:
    """MLflow's scoring server's answer to one /invocations JSON body (its request handler, and
    what its HTTP layer makes of an MlflowException), without the HTTP."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    try:
        answer = scoring_server.invocations(body, "application/json", model, model.metadata.get_input_schema())
    except MlflowException as e:
        return e.get_http_status_code(), json.loads(e.serialize_as_json())
    return answer.status, json.loads(answer.response)


def test_an_image_model_takes_uint8_pixels_and_png_and_jpeg_files_as_training_read_them(tmp_path):
    import base64
    import io

    from PIL import Image

    from flyscale.data import fields
    from flyscale_plugins.images import ShapesOptions, generate

    model, info, path = _image_model(tmp_path)
    images, _ = generate(6, ShapesOptions(size=8), chunk=0)  # uint8 (6, 3, 8, 8), as the splits store them
    field = info.input()
    want = _probabilities(path, fields.reader(info).to_model(images))  # what training fed the network
    png = [fields.encode_png(a) for a in images]
    for given in (
        images,  # uint8 pixels
        images.astype("int64"),  # integers, as JSON brings them
        images.astype("float32") / 255,  # floats in [0, 1], as before
        np.array(png, dtype=object),  # PNG files
        np.array([base64.b64encode(p).decode() for p in png], dtype=object),  # base64, as JSON brings them
    ):
        np.testing.assert_allclose(model.predict(given), want, atol=1e-6)
    jpeg = []
    for a in images:
        out = io.BytesIO()
        Image.fromarray(a.transpose(1, 2, 0)).save(out, format="JPEG", quality=80)
        jpeg.append(out.getvalue())
    decoded = np.stack([fields.decode_image(j, field) for j in jpeg])  # lossy: compared with training's decode
    np.testing.assert_allclose(
        model.predict(np.array(jpeg, dtype=object)),
        _probabilities(path, fields.reader(info).to_model(decoded)),
        atol=1e-6,
    )
    status, body = _ask(model, json.dumps({"inputs": images.tolist()}))  # integers over HTTP: pixels
    assert status == 200 and np.allclose(body["predictions"], want, atol=1e-6)

    saved = tmp_path / "model"
    assert "pillow==" in (saved / "requirements.txt").read_text()  # decodes as training did, in any environment
    forms = model.metadata.metadata["flyscale_serving"]["inputs"]
    assert forms[0].startswith("uint8 pixels 0-255") and "PNG or JPEG files of 8x8 pixels (RGB)" in forms[2]
    assert json.loads((saved / "artifacts" / "model_serving.json").read_text())["input"]["pixels"] == {
        "divisor": fields.PIXEL_DIVISOR
    }


REFUSED = {
    "NaN": (
        json.dumps(np.zeros((1, 3, 8, 8)).tolist()).replace("0.0", "NaN", 1),
        "NaN (or null) in 1 of 1 examples (the first: example 0); this model takes finite numbers",
    ),
    "infinity": (
        json.dumps((np.ones((2, 3, 8, 8)) / 2).tolist()).replace("0.5", "Infinity", 1),
        "infinite values in 1 of 2 examples (the first: example 0)",
    ),
    "an empty batch": ("[]", "an empty batch: send at least one example"),
    "a wrong shape": (
        json.dumps(np.zeros((1, 3, 8, 7)).tolist()),
        "inputs of shape (1, 3, 8, 7); this model takes (N, 3, 8, 8)",
    ),
    "channels last": (
        json.dumps(np.zeros((1, 8, 8, 3), int).tolist()),
        "(channels last: transpose it to channels first",
    ),
    "unscaled floats": (
        json.dumps(np.full((1, 3, 8, 8), 200.0).tolist()),
        "float pixels must be in [0, 1] (pixel / 255); these run from 200 to 200",
    ),
    "pixels past 255": (
        json.dumps(np.full((1, 3, 8, 8), 256).tolist()),
        "integer pixels must be 0-255; these run from 256 to 256",
    ),
    "not base64": ('["not an image!"]', "example 0 is a string that is not base64"),
    "not an image": ('["aGVsbG8="]', "example 0 is not a PNG or JPEG image"),
    "another size": ("PNG16", "example 0 is a 16x16 image; this model takes 8x8 (width x height)"),
}


@pytest.fixture(scope="module")
def image_model(tmp_path_factory):
    return _image_model(tmp_path_factory.mktemp("image-model"))[0]


@pytest.mark.parametrize("case", REFUSED)
def test_a_request_the_image_model_cannot_mean_is_a_400_in_one_line_that_names_the_problem(case, image_model):
    import base64

    from flyscale.data import fields

    inputs, message = REFUSED[case]
    if inputs == "PNG16":
        inputs = json.dumps([base64.b64encode(fields.encode_png(np.zeros((3, 16, 16), "uint8"))).decode()])
    status, body = _ask(image_model, '{"inputs": ' + inputs + "}")
    assert status == 400 and body["error_code"] == "INVALID_PARAMETER_VALUE", body
    assert message in body["message"] and "\n" not in body["message"], body["message"]
    assert "stack_trace" not in body and "Failed to predict" not in body["message"]  # the input is never echoed


def test_the_language_model_refuses_bad_params_prompts_that_are_not_text_and_prompts_past_its_context(tmp_path):
    target, _ = _saved("language model", tmp_path)
    model = mlflow.pyfunc.load_model(str(target))
    about = model.metadata.metadata["flyscale_serving"]
    assert about["context_length"] == 16 and "refused" in about["longer_prompts"]  # TOKENS: 17 a sequence

    def ask(inputs, **params) -> tuple[int, str]:
        status, body = _ask(model, json.dumps({"inputs": inputs, "params": params}))
        return status, body["message"] if status != 200 else body["predictions"]

    assert ask(["a" * 16], max_new_tokens=2, temperature=0)[0] == 200  # the whole context
    assert ask(["a"], max_new_tokens=3, temperature=1e-300)[0] == 200  # a tiny temperature: no NaN
    for inputs, params, message in [
        (["a" * 17], {}, "prompt 0 is 17 tokens; this model's context is 16 tokens: send at most 16"),
        (["a", 5], {}, "prompt 1 is a number, not text: a language model takes strings"),
        ([None], {}, "prompt 0 is null, not text"),
        (["a"], {"max_new_tokens": -5}, "max_new_tokens must be a whole number from 1 to 1024"),
        (["a"], {"max_new_tokens": 0}, "from 1 to 1024 (serving.max_new_tokens), got 0"),
        (["a"], {"max_new_tokens": 5000}, "from 1 to 1024 (serving.max_new_tokens), got 5000"),
        (["a"], {"temperature": -1}, "temperature must be a number >= 0 (0: the likeliest token), got -1.0"),
        (["a"], {"seed": -1}, "seed must be a whole number >= 0, got -1"),
    ]:
        status, said = ask(inputs, **params)
        assert status == 400 and message in said and "\n" not in said, said


@pytest.mark.slow
def test_requests_past_the_limits_written_into_the_model_are_400s_naming_the_config_field(tmp_path):
    """The serving section's limits travel in the model (its serving JSON): too many rows or
    prompts, a prompt too long, too many new tokens, and a generation past its time budget are
    each refused in one line that names the limit and the field that raises it."""
    import time

    from flyscale.config import ServingConfig

    limits = ServingConfig(
        max_rows=4, max_batch_size=4, max_prompts=3, max_prompt_chars=40, max_new_tokens=100_000, time_budget_s=0.3
    )
    classifier = mlflow.pyfunc.load_model(str(_saved("classifier", tmp_path / "c", limits.limits())[0]))
    target, _ = _saved("language model", tmp_path / "lm", limits.limits())
    assert json.loads((target / "artifacts" / "model_serving.json").read_text())["limits"] == limits.limits()
    lm = mlflow.pyfunc.load_model(str(target))
    assert lm.metadata.metadata["flyscale_serving"]["limits"]["serving.max_prompts"] == 3

    def refused(model, body: dict) -> str:
        status, answer = _ask(model, json.dumps(body))
        assert status == 400 and answer["error_code"] == "INVALID_PARAMETER_VALUE", answer
        assert "\n" not in answer["message"] and "stack_trace" not in answer, answer
        return answer["message"]

    assert _ask(classifier, json.dumps({"inputs": np.zeros((4, 4)).tolist()}))[0] == 200  # at the limit
    assert "5 examples in one request; this model answers at most 4 a request (serving.max_rows)" in refused(
        classifier, {"inputs": np.zeros((5, 4)).tolist()}
    )
    assert "4 prompts in one request; this model answers at most 3 a request (serving.max_prompts)" in refused(
        lm, {"inputs": ["a"] * 4}
    )
    assert "prompt 1 is 41 characters; this model reads at most 40 (serving.max_prompt_chars)" in refused(
        lm, {"inputs": ["a", "b" * 41]}
    )
    assert "from 1 to 100000 (serving.max_new_tokens), got 100001" in refused(
        lm, {"inputs": ["a"], "params": {"max_new_tokens": 100_001}}
    )
    started = time.monotonic()
    said = refused(lm, {"inputs": ["a"], "params": {"max_new_tokens": 100_000}})
    took = time.monotonic() - started
    assert said.startswith("generation ran past this model's time budget of 0.3 s (serving.time_budget_s) after "), said
    assert 0.3 <= took < 1.5, took  # stopped at the budget, not after 100,000 tokens
    assert _ask(lm, json.dumps({"inputs": ["a"], "params": {"max_new_tokens": 3}}))[0] == 200


def test_the_served_models_default_limits_are_the_serving_sections():
    """A version registered before its limits were written is held to the config's defaults."""
    from flyscale.config import ServingConfig
    from flyscale.export.onnx_pyfunc.predictor import LIMITS

    assert LIMITS == ServingConfig().limits()


def test_the_champion_is_scored_on_a_split_larger_than_one_request(tmp_path):
    """The gates score the registered champion on this run's test split a row group at a time
    (up to 65,536 rows): flyscale's own scoring sends it serving.max_rows at a time."""
    from flyscale.tracking.same_split import RegisteredModule
    from tests.registered import register

    uri = register(tmp_path, "limited", limits={"max_rows": 4})
    module = RegisteredModule(mlflow.pyfunc.load_model("models:/limited/1"))
    x = torch.rand(10, 64)
    scored = module(x)
    assert scored.shape == (10, 10) and uri.startswith("sqlite:")
    torch.testing.assert_close(scored[4:8], module(x[4:8]))


def test_a_pytorch_model_registered_before_model_io_had_its_name_still_finds_predict():
    """The model_code.py an older flyscale registered with a PyTorch model imports
    `flyscale.tracking.serving.predict`; that import keeps working."""
    from flyscale.tracking import model_io, serving

    assert serving.predict is model_io.predict


@pytest.mark.parametrize("case", ["classifier", "language model"])
def test_the_registered_model_carries_its_weights_as_safetensors(case, tmp_path):
    """Beside its ONNX file, every registered model holds its weights as safetensors, which load
    into the model its spec builds and answer as the trained weights do (the GPT's tied embedding
    and head included)."""
    from safetensors.torch import load_file

    target, files = _saved(case, tmp_path)
    found = sorted((target / "artifacts").glob("*.safetensors"))
    assert [p.name for p in found] == ["model_model.safetensors"]
    spec = json.loads(files.spec_json)
    trained = build(spec, files.weights_path)
    loaded = build(spec, files.weights_path)
    for p in loaded.parameters():
        torch.nn.init.zeros_(p)
    loaded.load_state_dict(load_file(str(found[0])), strict=True)
    x = torch.randint(0, 257, (2, 17)) if case == "language model" else torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(loaded(x), trained(x))


def test_int8_packed_weights_are_not_forced_into_safetensors(tmp_path):
    """torch.ao's int8 model keeps packed parameters, which safetensors cannot hold: none is written."""
    model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)), {torch.nn.Linear})
    assert not model_log.as_safetensors(save_state(model, "q.pt"), tmp_path / "q.safetensors")
    assert not (tmp_path / "q.safetensors").exists()


def test_a_classifier_of_labelled_text_takes_documents_and_tokenizes_them_as_training_did(tmp_path):
    """Its serving JSON says how training tokenized (the first seq_len ids, padded): a document
    sent as a string gets the probabilities of that row; rows of ids are still taken; an empty or
    too-long document is a 400 naming it."""
    info = DatasetInfo(
        "docs",
        2,
        [8],
        [],
        label_column="label",
        fields=[FieldSpec("tokens", "int32", [8], range=[0, 256]), FieldSpec("label", "int64", [])],
        input_field="tokens",
    )
    from flyscale.export import tiny_checkpoint

    bert = tiny_checkpoint.make("bert", tmp_path / "bert", labels=2, width=16, layers=1)
    model_cfg = ModelConfig(name="huggingface", options={"path": str(bert)})
    model = build_model(model_cfg, info).eval()
    with torch.no_grad():  # a random BERT's weights are small (std 0.02): make each position count
        for p in model.parameters():
            p.mul_(30)
    path = onnx.export(model, torch.randint(0, 257, (4, 8)), tmp_path / "m.onnx")
    files = model_log.ModelFiles(
        save_state(model, "m.pt"), spec_json(model_cfg, info, None), ByteTokenizer().to_json(), str(path),
        limits={"max_prompt_chars": 20},
    )  # fmt: skip
    mlflow.pyfunc.save_model(str(tmp_path / "model"), **model_log.model_args(files, "model", str(tmp_path)))
    served = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    assert "documents: strings" in served.metadata.metadata["flyscale_serving"]["inputs"][0]

    status, body = _ask(served, json.dumps({"inputs": ["hi", "é twelve bytes"]}))
    rows = np.array([[104, 105] + [256] * 6, [195, 169, 32, 116, 119, 101, 108, 118]], dtype="int64")
    assert not np.allclose(_probabilities(path, rows)[0], _probabilities(path, rows[:1] % 256)[0], atol=1e-3)
    assert status == 200
    np.testing.assert_allclose(body["predictions"], _probabilities(path, rows), atol=1e-6)
    status, body = _ask(served, json.dumps({"inputs": rows.tolist()}))
    np.testing.assert_allclose(body["predictions"], _probabilities(path, rows), atol=1e-6)
    for inputs, message in [
        (["fine", ""], "document 1 is empty: send text"),
        (["x" * 21], "document 0 has 21 characters; this model reads at most 20 (serving.max_prompt_chars)"),
        ([["a", "b"]], "send documents as a flat list of strings"),
    ]:
        status, body = _ask(served, json.dumps({"inputs": inputs}))
        assert status == 400 and message in body["message"], body
    # Batch prediction of a dataset of documents (flyscale.serving.batch, as workflows/predict.py
    # runs it per shard) tokenizes them with the version's tokenizer: the same probabilities.
    from flyscale.config import DataConfig
    from flyscale.serving import batch

    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "hi"}\n{"text": "é twelve bytes"}\n')
    data = DataConfig(dataset="text", options={"path": str(docs)})
    scored = batch.score_part(data, str(docs), str(tmp_path / "model"), tmp_path / "out" / "p.parquet")
    table = pq.read_table(scored.path)
    assert table.column("_source_row").to_pylist() == [0, 1] and scored.rows == 2
    np.testing.assert_allclose(table.column("scores").to_pylist(), _probabilities(path, rows), atol=1e-6)
    for line, why in [
        ('{"text": "   "}', "text is an empty document"),
        ("not json", r"text could not be read \(text: json"),
    ]:
        docs.write_text('{"text": "fine"}\n' + line + "\n")
        with pytest.raises(batch.BatchPredictError, match=rf"docs.jsonl row 1: {why}"):
            batch.score_part(data, str(docs), str(tmp_path / "model"), tmp_path / "out2" / "p.parquet")
