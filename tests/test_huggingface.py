"""A flyscale model in Hugging Face's format (flyscale/export/huggingface.py): a GPT written as a
GPT-2 folder (config.json, model.safetensors, tokenizer) that `transformers` loads offline and
that answers with flyscale's logits; the registered version through `flyscale huggingface`."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, ObjectiveConfig
from flyscale.data.text import ByteTokenizer, train_bpe
from flyscale.export.huggingface import NotExportable, save_pretrained
from flyscale.model import build_model
from flyscale.tracking import start

pytestmark = pytest.mark.timeout(300)


def _tokens(vocab: int, length: int = 17) -> DatasetInfo:
    field = FieldSpec("tokens", "int32", [length], range=[0, vocab - 1])
    return DatasetInfo("tokens", 0, [length], [], label_column="", fields=[field], input_field="tokens")


def _gpt(options: dict, info: DatasetInfo) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = ModelConfig(name="gpt", options=options)
    torch.manual_seed(0)
    model = build_model(cfg, info).eval()
    # Larger weights than GPT-2's initialisation, whose attention is nearly uniform (q and k could
    # trade places unseen), and norms and biases away from 1 and 0: a weight put in the wrong place shows.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.1)
    return cfg, model


@pytest.mark.parametrize(
    "options",
    [
        {"layers": 2, "heads": 2, "width": 32},  # nanoGPT's defaults: a tied head, no biases
        {"layers": 1, "heads": 4, "width": 32, "tie_embeddings": False, "bias": True},
    ],
    ids=["tied", "untied-with-biases"],
)
def test_a_gpt_loads_in_transformers_as_gpt2_with_the_same_logits(options, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = _tokens(257)
    cfg, model = _gpt(options, info)
    save_pretrained(cfg, info, model, ByteTokenizer().to_json(), tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    x = torch.randint(0, 257, (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-5)
    # The byte-level tokenizer: each byte's id is its value, end-of-text after them.
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert hf.config.eos_token_id == tok.eos_token_id == 256  # flyscale's end-of-text id

    # And back: model.init_from the folder starts a GPT of the same options from exactly these weights.
    again_cfg = ModelConfig(name="gpt", options=options, init_from=str(tmp_path))
    fetched = start.starting_weights(
        again_cfg, build_model(again_cfg, info, meta=True), info, lambda: tmp_path / "s", str
    )
    assert fetched is not None and fetched.source == f"the Hugging Face checkpoint {tmp_path}"
    again = build_model(again_cfg, info)
    again.load_state_dict(torch.load(fetched.weights_path, weights_only=True))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_gpt2_that_computes_something_else_is_refused_as_a_start(tmp_path):
    import json

    info = _tokens(257)
    cfg, model = _gpt({"layers": 1, "heads": 2, "width": 16, "bias": True}, info)
    save_pretrained(cfg, info, model, ByteTokenizer().to_json(), tmp_path)
    plain = ModelConfig(name="gpt", options={"layers": 1, "heads": 2, "width": 16}, init_from=str(tmp_path))
    with pytest.raises(
        start.StartError, match=r"has non-zero biases \(transformer.h.0.ln_1.bias\); set model.options.bias"
    ):
        start.starting_weights(plain, build_model(plain, info, meta=True), info, lambda: tmp_path / "a", str)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "gelu_new"}))
    same = ModelConfig(
        name="gpt", options={"layers": 1, "heads": 2, "width": 16, "bias": True}, init_from=str(tmp_path)
    )
    with pytest.raises(
        start.StartError, match="uses activation_function 'gelu_new'; model 'gpt' computes the exact GELU"
    ):
        start.starting_weights(same, build_model(same, info, meta=True), info, lambda: tmp_path / "b", str)
    untied = tmp_path / "untied"
    cfg, model = _gpt({"layers": 1, "heads": 2, "width": 16, "tie_embeddings": False}, info)
    save_pretrained(cfg, info, model, ByteTokenizer().to_json(), untied)
    tied = ModelConfig(name="gpt", options={"layers": 1, "heads": 2, "width": 16}, init_from=str(untied))
    with pytest.raises(start.StartError, match="has an output projection of its own .*tie_embeddings: false"):
        start.starting_weights(tied, build_model(tied, info, meta=True), info, lambda: tmp_path / "d", str)
    wider = ModelConfig(
        name="gpt", options={"layers": 1, "heads": 2, "width": 32, "bias": True}, init_from=str(tmp_path)
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        start.StartError,
        match=r"is another architecture than this run builds: 0.pos is float32 \[17, 16\] in its weights and float32 \[17, 32\]",
    ):
        start.starting_weights(wider, build_model(wider, info, meta=True), info, lambda: tmp_path / "c", str)


def test_a_bpe_tokenizer_gives_transformers_the_ids_flyscale_trained_on(tmp_path):
    from transformers import AutoTokenizer

    bpe = train_bpe(["the cat sat on the mat", "a cat and a hat", "the hat sat"] * 20, vocab_size=300)
    info = _tokens(bpe.vocab_size)
    cfg, model = _gpt({"layers": 1, "heads": 2, "width": 16}, info)
    save_pretrained(cfg, info, model, bpe.to_json(), tmp_path)
    text = "the cat in the hat"
    assert AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"] == bpe.encode_batch([text])[0].tolist()


def test_a_model_whose_plugin_does_not_say_what_it_is_there_is_refused_by_name(tmp_path):
    info = DatasetInfo("t", 3, [4], list("abcd"))
    cfg = ModelConfig(options={"hidden": [8]})
    with pytest.raises(NotExportable, match="model 'mlp' does not say what it is in Hugging Face's format"):
        save_pretrained(cfg, info, build_model(cfg, info), "", tmp_path)


@pytest.mark.slow
def test_flyscale_huggingface_writes_the_registered_champion(tmp_path, mlflow_server, monkeypatch):
    """`flyscale huggingface --model NAME --out DIR`, as a user runs it against a registry; an int8
    twin and a model with no Hugging Face form are refused in one line each."""
    import mlflow
    from mlflow import MlflowClient

    from flyscale.model import save_state
    from flyscale.tracking import model_log
    from flyscale.tracking.model_spec import spec_json

    uri = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("huggingface-tests")
    gpt_name, mlp_name = (f"tiny-{kind}-{uuid.uuid4().hex[:6]}" for kind in ("gpt", "mlp"))
    info = _tokens(257)
    cfg, model = _gpt({"layers": 1, "heads": 2, "width": 16}, info)
    client = MlflowClient(uri)
    mlp_info = DatasetInfo("t", 3, [4], list("abcd"))
    mlp_cfg = ModelConfig(options={"hidden": [8]})
    language = ObjectiveConfig(name="language_modeling", options={"max_new_tokens": 4, "temperature": 0.0})
    registered = {
        gpt_name: (model, spec_json(cfg, info, None, language), ByteTokenizer().to_json()),
        mlp_name: (build_model(mlp_cfg, mlp_info), spec_json(mlp_cfg, mlp_info, None), ""),
    }
    for name, (m, spec, tokenizer) in registered.items():
        with mlflow.start_run():
            logged = model_log.log_model(
                model_log.ModelFiles(save_state(m, "m.pt"), spec, tokenizer), "model", str(tmp_path)
            )
        version = mlflow.register_model(logged.model_uri, name)
        client.set_registered_model_alias(name, "champion", version.version)

    def run(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
        cmd = [str(Path(sys.executable).parent / "flyscale"), "huggingface", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)

    done = run("--model", gpt_name, "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{gpt_name} v1 in Hugging Face's format" in done.stdout
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 257, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-5)
    refused = run("--model", mlp_name, "--out", str(tmp_path / "mlp"))
    assert refused.returncode == 2 and "model 'mlp' does not say what it is" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
