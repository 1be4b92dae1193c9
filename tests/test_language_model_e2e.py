"""The text preset under `pyflyte run`, as a newcomer runs it (made small: one epoch of a tiny
GPT on the BPE variant, whose tokenizer is trained by the data stage and carried by the served
model): the summary shows perplexity, bits per byte, the unigram baseline, what int8 costs, the
gate verdicts and a generated sample; the registered model continues a prompt given as a string."""

from __future__ import annotations

import json

import mlflow
import pytest

from tests.conftest import REPO, run_pipeline

pytestmark = pytest.mark.timeout(600)

SMALL = json.dumps(
    {
        "tokenize": {"vocab_size": 320, "seq_len": 32},
        "model": {"options": {"layers": 1, "heads": 2, "width": 32}},
        "objective": {"options": {"prompts": ["The "], "sample_tokens": 12}},
        "train": {"epochs": 1, "batch_size": 64},
        # The gate every run of a model this small passes: it trained at all (a uniform guess over
        # 320 ids is 8.3 bits a token, ~3 bits a byte at this tokenizer's bytes per token).
        "gate": [
            {"name": "min_metric", "options": {"metric": "bits_per_byte", "threshold": 6.0}},
            {"name": "quantization", "options": {"max_worse": {"bits_per_byte": 0.5}}},
        ],
        "mlflow": {"model_name": "text-e2e"},
    }
)


@pytest.fixture(scope="module")
def run(tmp_path_factory, mlflow_server):
    presets = [str(REPO / "configs/text-gpt-bpe.yaml"), SMALL]
    args = [a for p in presets for a in ("--cfg", p)]
    home = tmp_path_factory.mktemp("home")
    # TMPDIR: flytekit's local sandbox, and so the Deck files, land under home.
    proc = run_pipeline(home, *args, env={"MLFLOW_TRACKING_URI": mlflow_server, "TMPDIR": str(home)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout, home


def test_the_summary_shows_what_a_language_model_is_judged_by(run):
    run, home = run
    assert "tokenizer   bpe, 320 ids" in run and "tokenize_text" in run, run[-3000:]
    fp32 = next(line for line in run.splitlines() if line.startswith("  fp32 "))
    assert "perplexity" in fp32 and "bits per byte" in fp32 and "accuracy" not in fp32.replace("token accuracy", "")
    int8 = next(line for line in run.splitlines() if line.startswith("  int8 "))
    assert "perplexity increase" in int8 and "bits per byte increase" in int8
    assert "baseline    unigram entropy" in run and "bits a token (training split)" in run
    assert "sample      'The " in run
    assert "per generated token: fp32 p50" in run
    assert "gate        min_metric: PASSED (test bits_per_byte" in run
    # The int8 twin when it pays (smaller and faster, as timed), judged on its loss; the summary says which it was.
    pays = "  int8        pays: " in run
    quantization = "(bits per byte increase" if pays else "(int8 is not registered"
    assert f"gate        quantization: PASSED {quantization}" in run, run[-3000:]
    twin = "registered  text-e2e v1, text-e2e-int8 v1" if pays else "registered  text-e2e v1 (no int8 twin)"
    assert twin in run and ("  int8        pays: " in run or "  int8        not registered: it does not pay" in run)
    # The quantize task's Evaluation Deck: the objective's metrics, what int8 costs, the samples.
    decks = [p.read_text() for p in home.glob("flyte-*/sandbox/local_flytekit/*/deck.html")]
    evaluation = [d for d in decks if "Evaluation on the test split (language_modeling)" in d]
    assert len(evaluation) == 1, f"{len(decks)} deck files"
    assert "perplexity increase" in evaluation[0] and "Generated (sampled, seed 0)" in evaluation[0]
    assert "<pre>The " in evaluation[0]


def test_the_registered_model_continues_a_prompt_given_as_a_string(run, mlflow_server):
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/text-e2e@champion")
    params = model.metadata.get_params_schema().to_dict()
    assert {p["name"] for p in params} == {"max_new_tokens", "temperature", "seed"}
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    out = model.predict("The ", params=greedy)
    assert len(out) == 1 and isinstance(out[0], str) and out[0]
    assert model.predict(["The ", "A list"], params=greedy)[0] == out[0]  # batched as given alone
    # The int8 model is registered beside it, its Linear layers quantized by ONNX Runtime.
    client = mlflow.MlflowClient()
    run_id = client.get_model_version_by_alias("text-e2e", "champion").run_id
    metrics = client.get_run(run_id).data.metrics
    # The files as served: smaller, though in a model this small the fp32 embeddings weigh most.
    assert metrics["test_int8_size_ratio"] > 1.2
    assert "test_perplexity" in metrics and "test_int8_perplexity_increase" in metrics
    artifacts = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert {"samples/fp32.txt", "samples/int8.txt"} <= artifacts
    assert client.get_run(run_id).data.tags["flyscale.sample"].startswith("The ")
