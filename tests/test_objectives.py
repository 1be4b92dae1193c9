"""The objectives at the unit level: what each evaluation reports, what int8 costs on it, the
config refusing a gate the objective cannot feed, and the language model's served predict."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from flyscale.config import ConfigError, ModelConfig, PipelineConfig
from flyscale.data.text import ByteTokenizer
from flyscale.evaluate.comparison import costs
from flyscale.evaluate.metrics import evaluate_batches
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.plugin.contracts import DatasetInfo, FieldSpec, ObjectiveContext
from flyscale.train.objective import of

SEQ = 17
INFO = DatasetInfo(
    "t",
    0,
    [SEQ],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [SEQ], range=[0, 256])],
    input_field="tokens",
)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return build_model(ModelConfig("gpt", {"layers": 1, "heads": 2, "width": 16}), INFO).eval()


def _lm(**options):
    from flyscale.config import ObjectiveConfig

    return of(ObjectiveConfig("language_modeling", options))


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_language_model_metrics_are_per_token_and_do_not_depend_on_batching(gpt, batch):
    x = torch.randint(0, 257, (8, SEQ), generator=torch.Generator().manual_seed(1))
    y = torch.zeros(8, dtype=torch.long)
    context = ObjectiveContext(INFO, bytes_per_token=2.5)
    m = evaluate_batches(gpt, ((x[i : i + batch], y[i : i + batch]) for i in range(0, 8, batch)), _lm(), context)
    with torch.no_grad():
        logits = gpt(x[:, :-1])
    loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 257), x[:, 1:].reshape(-1)))
    assert m.objective == "language_modeling" and m.n == 8 * (SEQ - 1)
    assert m.loss == pytest.approx(loss, rel=1e-5)
    assert m.values["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert m.values["bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-5)
    assert m.values["bits_per_byte"] == pytest.approx(loss / math.log(2) / 2.5, rel=1e-5)
    hits = float((logits.argmax(-1) == x[:, 1:]).float().mean())
    assert m.values["token_accuracy"] == pytest.approx(hits)
    assert set(m.scalars("int8_")) >= {"int8_perplexity", "int8_loss", "int8_size_bytes"}
    assert "int8_accuracy" not in m.scalars("int8_")  # a classifier's fields are not reported for it


def test_what_int8_costs_is_named_by_which_way_is_worse(gpt):
    from flyscale.evaluate.metrics import EvalMetrics

    def metrics(ppl: float, acc: float) -> EvalMetrics:
        values = {"perplexity": ppl, "token_accuracy": acc, "tokens_per_s": 1.0}
        return EvalMetrics(0, 0, 0, 1, [], 0, objective="language_modeling", values=values)

    got = costs(metrics(9.0, 0.40), metrics(9.3, 0.38), _lm().metrics)
    assert got == pytest.approx({"perplexity_increase": 0.3, "token_accuracy_drop": 0.02})


def test_a_gate_on_a_metric_the_objective_does_not_record_is_refused_when_the_config_is_read():
    text = {"data": {"dataset": "python_docs"}, "model": {"name": "gpt"}, "objective": {"name": "language_modeling"}}
    with pytest.raises(ConfigError, match=r"gate 'min_metric' reads 'accuracy', which objective 'language_modeling'"):
        PipelineConfig.from_dict(text)  # the default gates read accuracy
    quantization = {"name": "quantization", "options": {"max_worse": {"perplexity": 0.1}}}
    ok = PipelineConfig.from_dict(
        {**text, "gate": [{"name": "min_metric", "options": {"metric": "perplexity"}}, quantization]}
    )
    assert ok.objective.name == "language_modeling"
    with pytest.raises(ConfigError, match=r"reads 'int8_accuracy_drop'.*int8_perplexity_increase"):
        PipelineConfig.from_dict({**text, "gate": {"name": "quantization"}})
    with pytest.raises(ConfigError, match=r"reads 'r2'"):
        PipelineConfig.from_dict({"gate": {"name": "min_metric", "options": {"metric": "r2", "threshold": 0.5}}})


def test_the_served_language_model_takes_text_and_returns_its_continuations(gpt):
    lm, tok = _lm(), ByteTokenizer()
    context = ObjectiveContext(INFO, tokenizer_json=tok.to_json())
    greedy = {"max_new_tokens": 5, "temperature": 0.0}
    alone = [lm.predict(gpt, p, greedy, context)[0] for p in ("abc", "xyz", "hello")]
    # Prompts of one length are generated as one batch; the answers are each prompt's alone.
    assert lm.predict(gpt, ["abc", "hello", "xyz"], greedy, context) == [alone[0], alone[2], alone[1]]
    assert lm.predict(gpt, pd.DataFrame({"prompt": ["abc"]}), greedy, context) == alone[:1]
    assert all(isinstance(a, str) and a for a in alone)
    sampled = [lm.predict(gpt, "abc", {"max_new_tokens": 20, "seed": s}, context)[0] for s in (0, 0, 1)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]  # the seed decides a sample
    with pytest.raises(ValueError, match="unknown params"):
        lm.predict(gpt, "abc", {"top_k": 5}, context)
    example, params = lm.example(context)
    assert example == ["The "] and params == {"max_new_tokens": 64, "temperature": 0.8, "seed": 0}
    without = ObjectiveContext(INFO)
    with pytest.raises(ValueError, match="registered without it"):
        lm.predict(gpt, "abc", greedy, without)


def test_the_samples_continue_the_configured_prompts_the_same_way_each_time(gpt):
    lm = _lm(prompts=["def ", "The "], sample_tokens=6)
    context = ObjectiveContext(INFO, tokenizer_json=ByteTokenizer().to_json())
    first, again = lm.samples(gpt, context), lm.samples(gpt, context)
    assert list(first) == ["def ", "The "] and first == again
    assert lm.samples(gpt, ObjectiveContext(INFO)) == {}  # no tokenizer: nothing to decode with


def test_every_objective_is_a_valid_plugin_with_metrics_of_a_known_direction():
    from flyscale.api import higher_is_better

    for name in ("classification", "regression", "language_modeling"):
        objective = registry.objectives.get(name)
        assert objective.headline in objective.metrics
        for metric, up in objective.metrics.items():
            if "*" not in metric:
                assert higher_is_better(metric) is up, (name, metric)


def test_a_scaling_study_measures_a_language_model_by_its_loss_per_token_with_a_standard_error(gpt):
    from flyscale.scaling.measure import BLOCK, measure, metric_of, unit_of

    x = torch.randint(0, 257, (40, SEQ), generator=torch.Generator().manual_seed(2))
    y = torch.zeros(40, dtype=torch.long)
    lm = _lm()
    got = measure(gpt, [(x[:24], y[:24]), (x[24:], y[24:])], lm)  # two row groups
    whole = evaluate_batches(gpt, [(x, y)], lm, ObjectiveContext(INFO))
    assert (metric_of(lm), unit_of(lm)) == ("loss", "token")
    assert got.value == pytest.approx(whole.loss, rel=1e-5) and got.count == 40 * (SEQ - 1) and got.examples == 40
    with torch.no_grad():  # the standard error of the mean of 5 blocks of BLOCK consecutive sequences
        per_seq = torch.nn.functional.cross_entropy(gpt(x[:, :-1]).transpose(1, 2), x[:, 1:], reduction="none")
    means = per_seq.mean(1).reshape(-1, BLOCK).mean(1)
    assert BLOCK == 8 and got.noise == pytest.approx(float(means.std() / len(means) ** 0.5), rel=1e-4)


def test_a_scaling_study_measures_a_classifier_by_its_error_with_binomial_noise():
    from flyscale.scaling.measure import measure, metric_of

    info = DatasetInfo("t", 3, [4], ["a", "b", "c", "d"])
    torch.manual_seed(0)
    model = build_model(ModelConfig("mlp", {"hidden": [8]}), info)
    x, y = torch.randn(50, 4), torch.randint(0, 3, (50,))
    got = measure(model, [(x, y)], of_default := registry.objectives.get("classification"))
    with torch.no_grad():
        error = 1 - float((model(x).argmax(1) == y).float().mean())
    assert metric_of(of_default) == "error" and got.count == 50
    assert got.value == pytest.approx(error) and got.noise == pytest.approx((error * (1 - error) / 50) ** 0.5)
