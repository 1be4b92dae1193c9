"""A Hugging Face causal LM fine-tuned as a new user does it, from a fresh clone: `flyscale
tiny-checkpoint llama` saves the checkpoint, `pyflyte run ... --cfg configs/text-llama.yaml`
fine-tunes it under fsdp on 2 workers (each decoder layer a unit) and registers it, `mlflow
models serve` answers a prompt over HTTP, and the version written back out by `flyscale
huggingface` continues the prompt in `transformers` with the same words."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
import uuid

import pytest
from conftest import BIN, run_pipeline

from flyscale.serving import servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPTS = ["The ", "Lists "]


def test_a_saved_causal_lm_fine_tunes_under_fsdp_registers_and_answers_over_http(
    tmp_path, mlflow_server, serving_envs, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tmp_path / "tiny-llama"
    made = subprocess.run(
        [str(BIN / "flyscale"), "tiny-checkpoint", "llama", "--out", str(checkpoint)], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-2000:]
    name = f"hf-llama-{uuid.uuid4().hex[:8]}"
    mine = {
        "model": {"options": {"path": str(checkpoint)}},
        "tokenize": {"tokenizer": str(checkpoint)},
        "mlflow": {"model_name": name},
    }
    proc = run_pipeline(
        tmp_path,
        "--cfg",
        "configs/text-llama.yaml",
        "--cfg",
        json.dumps(mine),
        env={"MLFLOW_TRACKING_URI": mlflow_server},
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "workers     2 (FLYSCALE_NPROC_PER_NODE=2)" in out
    assert f"started     from the Hugging Face checkpoint {checkpoint} (weights sha256" in out
    assert "tokenizer   pretrained, 257 ids" in out
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

    exported = tmp_path / "exported"
    written = subprocess.run(
        [str(BIN / "flyscale"), "huggingface", "--model", name, "--version", "1", "--out", str(exported)],
        capture_output=True,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server},
    )
    assert written.returncode == 0, written.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    for prompt, answer in zip(PROMPTS, served):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        made_ids = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert tokenizer.decode(made_ids[0, ids.shape[1] :]) == answer  # greedy: the same tokens
