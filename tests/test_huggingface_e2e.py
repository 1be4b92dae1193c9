"""A Hugging Face causal LM fine-tuned as a new user does it, from a fresh clone: `flyscale
tiny-checkpoint llama` saves the checkpoint, `pyflyte run ... --cfg configs/text-llama.yaml`
fine-tunes it under fsdp on 2 workers (each decoder layer a unit) and registers it, `mlflow
models serve` answers a prompt over HTTP, and the version written back out by `flyscale
huggingface` continues the prompt in `transformers` with the same words. A tokenizer replaced
under the same folder tokenizes the documents again. A LoRA run (Ctrl-C'd, then resumed), a ViT on
the image preset, and a BERT on the digits read as token ids and on labelled text go through the
same pipeline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from conftest import BIN, REPO, run_pipeline

from flyscale.serving import servers
from tests.test_resume_e2e import _ctrl_c_after

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPTS = ["The ", "Lists "]


def _tiny_checkpoint(out, arch: str, *options: str):
    """`flyscale tiny-checkpoint ARCH OPTIONS --out OUT`, as the docs give it; it must succeed."""
    made = subprocess.run(
        [str(BIN / "flyscale"), "tiny-checkpoint", arch, *options, "--out", str(out)], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The preset's checkpoint, made by the command its comment gives."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("checkpoints") / "tiny-llama", "llama")


def _fine_tune(
    prefix: str, checkpoint, tmp_path, uri: str, more: dict | None = None, ctrl_c_at: int = 0
) -> tuple[str, str]:
    """`pyflyte run ... --cfg configs/text-llama.yaml` on `checkpoint` (and `more`, merged last);
    the registered name and the output. It must succeed. `ctrl_c_at`: the same command is first
    Ctrl-C'd once a checkpoint of that step is written (test_resume_e2e's `_ctrl_c_after`)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    mine = {
        "model": {"options": {"path": str(checkpoint)}},
        "tokenize": {"tokenizer": str(checkpoint)},
        "mlflow": {"model_name": name},
    }
    args = ["--cfg", "configs/text-llama.yaml", "--cfg", json.dumps(mine)]
    if more:
        args += ["--cfg", json.dumps(more)]
    env = {"MLFLOW_TRACKING_URI": uri}
    left = _ctrl_c_after(tmp_path, args, env, ctrl_c_at, tmp_path / "interrupted.log") if ctrl_c_at else 0
    proc = run_pipeline(tmp_path, *args, env=env, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    if left:
        assert f"  training    resumed from step {left} (" in out, out[-3000:]
    return name, out


def _written(name: str, tmp_path, uri: str):
    """The folder `flyscale huggingface` writes the registered version 1 of `name` to."""
    exported = tmp_path / "exported"
    written = subprocess.run(
        [str(BIN / "flyscale"), "huggingface", "--model", name, "--version", "1", "--out", str(exported)],
        capture_output=True,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
    )
    assert written.returncode == 0, written.stderr[-2000:]
    return exported


def _export(name: str, tmp_path, uri: str):
    """The registered version 1 of `name` written out by `flyscale huggingface`, loaded by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = _written(name, tmp_path, uri)
    return AutoTokenizer.from_pretrained(exported), AutoModelForCausalLM.from_pretrained(exported).eval()


def _predicted_elsewhere(name: str, uri: str, inputs: list, params: dict | None = None) -> list:
    """What the registered version 1 of `name` answers `inputs` (prompts, or rows of token ids),
    loaded as a user loads it, in a process of its own: this one's MLflow may point at another
    store (a test before it set it)."""
    load = (
        "import json, sys, mlflow, numpy as np; model = mlflow.pyfunc.load_model(sys.argv[1]); "
        "x, params = json.loads(sys.argv[2]), json.loads(sys.argv[3]); "
        "x = x if isinstance(x[0], str) else np.asarray(x, dtype='int64'); "
        "print(json.dumps(np.asarray(model.predict(x, params=params)).tolist()))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load, f"models:/{name}/1", json.dumps(inputs), json.dumps(params)],
        capture_output=True,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
        timeout=300,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    return json.loads(loaded.stdout.strip().splitlines()[-1])


def test_a_saved_causal_lm_fine_tunes_under_fsdp_registers_and_answers_over_http(
    checkpoint, tmp_path, mlflow_server, serving_envs, monkeypatch
):
    name, out = _fine_tune("hf-llama", checkpoint, tmp_path, mlflow_server)
    assert "workers     2 (FLYSCALE_NPROC_PER_NODE=2)" in out
    assert f"started     from the Hugging Face checkpoint {checkpoint} (weights sha256" in out
    assert "tokenizer   pretrained, 257 ids" in out
    assert "parameters  106,944, all trained" in out
    assert f"registered  {name} v1" in out

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    params = {"max_new_tokens": 12, "temperature": 0.0}
    with servers.mlflow_serve(f"models:/{name}/1", serving_envs) as base:
        request = urllib.request.Request(
            f"{base}/invocations",
            data=json.dumps({"inputs": PROMPTS, "params": params}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            served = json.loads(response.read())["predictions"]
    assert len(served) == 2 and all(served), served

    tokenizer, model = _export(name, tmp_path, mlflow_server)
    for prompt, answer in zip(PROMPTS, served):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        made_ids = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert tokenizer.decode(made_ids[0, ids.shape[1] :]) == answer  # greedy: the same tokens

    # The checkpoint's tokenizer changed under the same folder name (another end-of-text token):
    # the documents, from this run's cache, are tokenized again.
    config = checkpoint / "tokenizer_config.json"
    kept = config.read_text()
    try:
        config.write_text(kept.replace('"eos_token": "<|endoftext|>"', '"eos_token": "A"'))
        mine = {
            "model": {"options": {"path": str(checkpoint)}},
            "tokenize": {"tokenizer": str(checkpoint)},
            "mlflow": {"model_name": name},  # the data's reference, as the run read it
        }
        proc = run_pipeline(
            tmp_path,
            "--cfg",
            "configs/text-llama.yaml",
            "--cfg",
            json.dumps(mine),
            env={"MLFLOW_TRACKING_URI": mlflow_server},
            target=("workflows/data.py", "prepare_data"),
        )
    finally:
        config.write_text(kept)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "cache       ran tokenize_text; from the cache: combine_shards, prepare_shard" in proc.stdout + proc.stderr


def test_lora_trains_under_five_percent_of_the_weights_resumes_after_ctrl_c_and_registers_them_merged(
    checkpoint, tmp_path, mlflow_server
):
    """The same preset with model.options.lora, Ctrl-C'd mid-training and run again: it resumes
    from its sharded checkpoint of the adapters, the summary counts them, and what is registered
    is a plain model with them merged in (transformers loads it without peft, and it answers as
    the registered ONNX model does)."""
    lora = {
        "model": {"options": {"lora": {"r": 4, "alpha": 8}}},
        "train": {"lr": 0.01},
        "gate": [{"name": "min_metric", "options": {"metric": "perplexity", "threshold": 1000}}],
        "recovery": {"checkpoint_every_steps": 10},
    }
    name, out = _fine_tune("hf-lora", checkpoint, tmp_path, mlflow_server, lora, ctrl_c_at=10)
    assert re.search(r"; \d+ of \d+ steps computed after it", out), out[-3000:]
    assert "parameters  1,792 of 108,736 trained (1.65%; the rest frozen)" in out
    assert f"registered  {name} v1" in out

    tokenizer, model = _export(name, tmp_path, mlflow_server)
    assert not any("lora" in k for k in model.state_dict())
    served = _predicted_elsewhere(name, mlflow_server, PROMPTS, {"max_new_tokens": 8, "temperature": 0.0})
    for prompt, answer in zip(PROMPTS, served):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        assert tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]) == answer


def test_an_image_classifier_checkpoint_fine_tunes_on_the_image_preset(tmp_path, mlflow_server):
    """A ViT saved by `flyscale tiny-checkpoint vit` on the shapes preset's images (made smaller),
    under fsdp: its weights start the run, ONNX answers as PyTorch does, and it is registered."""
    vit = _tiny_checkpoint(tmp_path / "tiny-vit", "vit", "--labels", "4", "--image-size", "16")
    name = f"hf-vit-{uuid.uuid4().hex[:8]}"
    mine = {
        "data": {"options": {"rows": 400, "size": 16}},
        "model": {"name": "huggingface", "options": {"path": str(vit)}},
        "train": {"epochs": 1, "strategy": "fsdp"},
        "gate": [{"name": "min_metric", "options": {"threshold": 0.0}}],
        "mlflow": {"model_name": name},
    }
    proc = run_pipeline(
        tmp_path,
        "--cfg",
        "configs/images-cnn.yaml",
        "--cfg",
        json.dumps(mine),
        env={"MLFLOW_TRACKING_URI": mlflow_server},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert f"started     from the Hugging Face checkpoint {vit} (weights sha256" in out
    assert "the same prediction on every one: artifact onnx/model.onnx" in out
    assert f"registered  {name} v1" in out


def test_a_sequence_classifier_checkpoint_fine_tunes_on_digits_read_as_token_ids(tmp_path, mlflow_server):
    """A BERT saved by `flyscale tiny-checkpoint bert --labels 10` on `digit_tokens` (each digit's
    64 pixel intensities as token ids) under fsdp, as docs/huggingface.md gives it: its weights
    start the run, it learns (above chance, 0.1) and it is registered. (What its served model and
    `flyscale huggingface` answer is the labelled-text test's.)"""
    bert = _tiny_checkpoint(tmp_path / "tiny-bert", "bert", "--labels", "10", "--width", "32", "--layers", "1")
    name = f"hf-bert-{uuid.uuid4().hex[:8]}"
    mine = {
        "data": {"dataset": "digit_tokens"},
        "model": {"name": "huggingface", "options": {"path": str(bert)}},
        "train": {"strategy": "fsdp", "epochs": 4, "lr": 0.003},
        "gate": [{"name": "min_metric", "options": {"threshold": 0.12}}],
        "mlflow": {"model_name": name},
    }
    proc = run_pipeline(tmp_path, "--cfg", json.dumps(mine), env={"MLFLOW_TRACKING_URI": mlflow_server})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert f"started     from the Hugging Face checkpoint {bert} (weights sha256" in out
    assert "gate        min_metric: PASSED" in out and f"registered  {name} v1" in out


def _documented_labelled_text() -> tuple[str, dict]:
    """docs/huggingface.md's "Classify labelled text" as written: the Python that makes
    code-or-prose.jsonl, and the run's --cfg."""
    page = (REPO / "docs" / "huggingface.md").read_text()
    block = page.split("## Classify labelled text", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    script = block.split("<<'EOF'", 1)[1].split("\n", 1)[1].split("\nEOF\n", 1)[0]
    cfg = block.split("--cfg '", 1)[1].rsplit("'", 1)[0]
    return script, json.loads(cfg)


def test_a_sequence_classifier_fine_tunes_on_labelled_text_and_its_served_model_reads_text(
    tmp_path, mlflow_server, serving_envs, monkeypatch
):
    """docs/huggingface.md's labelled text, as written (the file its Python makes, a BERT from
    `flyscale tiny-checkpoint bert --labels 2`, its --cfg) under fsdp on 2 workers: a document of an
    unlisted class is quarantined naming it, each document is one padded row, the classifier
    learns (the classes are about even), and the registered model answers text over HTTP with the
    probabilities transformers gives the version `flyscale huggingface` writes back, tokenized,
    padded and masked by its own tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    script, cfg = _documented_labelled_text()
    made = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    data = tmp_path / "code-or-prose.jsonl"
    with data.open("a") as f:
        f.write(json.dumps({"text": "Shall I compare thee to a summer's day?", "kind": "poetry"}) + "\n")
    bert = _tiny_checkpoint(tmp_path / "tiny-bert-2", "bert", "--labels", "2", "--width", "32", "--layers", "1")
    name = f"hf-bert-text-{uuid.uuid4().hex[:8]}"
    cfg["data"]["options"]["path"] = str(data)
    cfg["model"]["options"]["path"] = cfg["tokenize"]["tokenizer"] = str(bert)
    cfg["mlflow"]["model_name"] = name
    proc = run_pipeline(tmp_path, "--cfg", json.dumps(cfg), env={"MLFLOW_TRACKING_URI": mlflow_server})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "workers     2 (FLYSCALE_NPROC_PER_NODE=2)" in out
    assert "1 quarantined (label: class: 1)" in out
    assert "cut at 64 tokens)" in out and "one row of 64 a document, padded with id 256" in out
    assert f"started     from the Hugging Face checkpoint {bert} (weights sha256" in out
    assert "gate        min_metric: PASSED" in out and f"registered  {name} v1" in out

    documents = ["for line in lines:\n    print(line)", "The value is set when the interpreter starts.", "x" * 300]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    with servers.mlflow_serve(f"models:/{name}/1", serving_envs) as base:
        request = urllib.request.Request(
            f"{base}/invocations",
            data=json.dumps({"inputs": documents}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            served = np.asarray(json.loads(response.read())["predictions"])
    assert served.shape == (3, 2)

    exported = _written(name, tmp_path, mlflow_server)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    batch = tokenizer(documents, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    with torch.no_grad():
        theirs = model(**batch).logits.softmax(-1).numpy()
    np.testing.assert_allclose(served, theirs, atol=1e-4)
