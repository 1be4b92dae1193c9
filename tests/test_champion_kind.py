"""A champion belongs to one kind of model, and is judged on the candidate's data.

- The default name comes from the data and the objective; a name a config sets is kept.
- Kinds compare what a client sends and what the model is for; a model of another kind is
  refused under a name, naming both kinds and the option, read from a real MLflow store.
- The champion's registered model, loaded as serving loads it and scored on the candidate's test
  split, gives the metrics its own network gives there, for every objective; a champion that
  cannot be scored there fails the gate closed, or does what the gate's options say.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import GateConfig, GatesConfig, MlflowConfig, ModelConfig, ObjectiveConfig, PipelineConfig
from flyscale.data.text import ByteTokenizer
from flyscale.evaluate import gating
from flyscale.evaluate.gating import ChampionRef
from flyscale.model import build_model
from flyscale.plugin.contracts import ObjectiveContext
from flyscale.tracking import kind, same_split
from flyscale.tracking.kind import ModelKind
from flyscale.train import objective as objectives
from tests.registered import DIGITS, register

LM_GATES = [{"name": "min_metric", "options": {"metric": "perplexity", "threshold": 20}}]
REGRESSION_GATES = [{"name": "min_metric", "options": {"metric": "r2", "threshold": 0.4}}]


@pytest.mark.parametrize(
    "preset, name",
    [
        ({}, "flyscale-digits"),  # the quickstart's, which the README names
        ({"data": {"dataset": "image_folder", "options": {"path": "/photos"}}}, "flyscale-image-folder"),
        ({"data": {"dataset": "parquet", "options": {"path": "/rows"}}}, "flyscale-parquet"),
        (
            {"data": {"dataset": "python_docs"}, "objective": {"name": "language_modeling"}, "gate": LM_GATES},
            "flyscale-python-docs",  # the objective the corpus is for: not in the name
        ),
        (
            {"data": {"dataset": "diabetes"}, "objective": {"name": "regression"}, "gate": REGRESSION_GATES},
            "flyscale-diabetes",
        ),
        ({"data": {"dataset": "diabetes"}}, "flyscale-diabetes-classification"),  # another objective: named
        ({"data": {"dataset": "image_folder", "options": {"path": "/p"}}, "mlflow": {"model_name": "mine"}}, "mine"),
    ],
)
def test_the_default_name_comes_from_the_data_and_the_objective(preset, name):
    cfg = PipelineConfig.from_dict(preset)
    assert cfg.mlflow.model_name == name
    again = PipelineConfig.from_dict({**preset, "mlflow": {"model_name": cfg.mlflow.model_name}})
    assert again == cfg  # the effective config, fed back, is the same config


def test_a_model_name_that_breaks_a_model_uri_is_refused():
    with pytest.raises(ValueError, match="mlflow.model_name 'a/b': no '/'"):
        MlflowConfig(model_name="a/b")


IMAGES = DatasetInfo(
    "photos",
    4,
    [3, 32, 32],
    [],
    fields=[FieldSpec("image", "uint8", [3, 32, 32], "png", [0, 255]), FieldSpec("label", "int64", [])],
    input_field="image",
)


def test_kinds_compare_what_a_client_sends_and_what_the_model_is_for():
    digits = ModelKind.of(DIGITS, "classification")
    assert digits.same(ModelKind.of(DatasetInfo("other name", 3, [64], list(DIGITS.feature_columns)), "classification"))
    photos = ModelKind.of(IMAGES, "classification")
    assert digits.differences(photos) == ["input float32[64] vs uint8[3, 32, 32]"]
    assert str(photos) == "uint8[3, 32, 32] (classification)"
    assert (
        str(digits) == "64 float features (pixel_0, pixel_1, pixel_2, pixel_3, pixel_4, ..., pixel_63; classification)"
    )
    renamed = DatasetInfo("d", 10, [64], [*DIGITS.feature_columns[:63], "age"])
    assert digits.differences(ModelKind.of(renamed, "classification")) == [
        "columns missing ['pixel_63']; added ['age']"
    ]
    shuffled = DatasetInfo("d", 10, [64], list(reversed(DIGITS.feature_columns)))
    assert digits.differences(ModelKind.of(shuffled, "classification")) == ["the same columns in another order"]
    assert digits.differences(ModelKind.of(DIGITS, "regression")) == ["objective classification vs regression"]
    # A language model takes prompts: its tokenizer and context are its own, not its kind.
    text = ModelKind.of(TOKENS, "language_modeling")  # the tokenize step's sequences (below)
    assert text.text and str(text) == "text prompts (language_modeling)"
    longer = DatasetInfo(
        "d", 0, [128], [], label_column="", fields=[FieldSpec("tokens", "int32", [128])], input_field="tokens"
    )
    assert text.same(ModelKind.of(longer, "language_modeling"))
    # The tag holds the kind whole, or a wide table's columns cut (the comparison is by their hash).
    assert ModelKind.from_json(digits.to_json()) == digits
    wide = ModelKind.of(DatasetInfo("w", 2, [900], [f"feature_number_{i}" for i in range(900)]), "classification")
    back = ModelKind.from_json(wide.to_json())
    assert len(wide.to_json()) < 4000 and back.same(wide) and back != wide
    assert "feature_number_899" in str(back)


BYTES = ByteTokenizer().to_json()
PIXELS = DatasetInfo(
    "digits_images",
    10,
    [1, 8, 8],
    [],
    fields=[FieldSpec("image", "uint8", [1, 8, 8], range=[0, 255]), FieldSpec("label", "int64", [])],
    input_field="image",
)
VALUES = DatasetInfo(
    "r",
    1,
    [4],
    [],
    label_column="y",
    fields=[FieldSpec("x", "float32", [4]), FieldSpec("y", "float32", [])],
    input_field="x",
)
TOKENS = DatasetInfo(
    "docs",
    0,
    [17],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [17], range=[0, 256])],
    input_field="tokens",
)
# (the data, the model, the objective, a tokenizer): one registered champion each.
CASES = {
    "table": (DIGITS, ModelConfig(), ObjectiveConfig(), ""),
    "pixels": (PIXELS, ModelConfig(name="cnn", options={"channels": [8], "hidden": 16}), ObjectiveConfig(), ""),
    "values": (VALUES, ModelConfig(options={"hidden": [8]}), ObjectiveConfig(name="regression"), ""),
    "text": (
        TOKENS,
        ModelConfig(name="gpt", options={"layers": 1, "heads": 2, "width": 32}),
        ObjectiveConfig(name="language_modeling", options={"prompts": ["a"]}),
        BYTES,
    ),
}


NAMES = {"table": "flyscale-digits"}  # the quickstart's champion, for the refusal below


def _split(case: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A test split as evaluation reads it: float inputs (pixels / 255), labels or targets."""
    rng = np.random.default_rng(7)
    if case == "table":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = digits.data[:240].astype("float32"), digits.target[:240]
    elif case == "pixels":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (np.round(digits.images[:240] * 255 / 16) / 255).astype("float32")[:, None]
        y = digits.target[:240]
    elif case == "values":
        x = rng.normal(size=(240, 4)).astype("float32")
        y = (x.sum(axis=1) * 3).astype("float32")
    else:
        x, y = rng.integers(0, 257, size=(48, 17)), np.zeros(48)
    batches = [(torch.from_numpy(x[i : i + 80]), torch.from_numpy(y[i : i + 80])) for i in range(0, len(x), 80)]
    if case == "text":  # scored on the network itself, never through predict
        return batches
    return batches + [(torch.from_numpy(x[:0]), torch.from_numpy(y[:0]))]  # a shard with none of the split's rows


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Each case's model registered as `<case>` v1 @champion in one SQLite store (the table's as
    `flyscale-digits`), as tests/registered.py registers it: without the kind tag, as before it
    existed, so its kind is read from the spec its model carries. The store's URI."""
    home = tmp_path_factory.mktemp("same-split")
    for case, (info, model_cfg, objective_cfg, tokenizer) in CASES.items():
        uri = register(home, NAMES.get(case, case), info, model_cfg, objective_cfg, tokenizer)
    return uri


@pytest.fixture
def live(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    return store


def _score(case: str, info=None, champion: str | None = None, tokenizer: str | None = None, **cfg) -> ChampionRef:
    data, _, objective_cfg, registered_tokenizer = CASES[case]
    info = info or data
    ref = ChampionRef(
        champion or NAMES.get(case, case), "champion", "1", "run", {"accuracy": 0.99, "loss": 0.01}, "a" * 64
    )
    context = ObjectiveContext(info, tokenizer_json=registered_tokenizer if tokenizer is None else tokenizer)
    goal = objectives.of(objective_cfg)
    kind = ModelKind.of(info, objective_cfg.name)
    return same_split.score(MlflowConfig(model_name=ref.model_name, **cfg), ref, kind, _split(case), goal, context)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_the_champion_is_scored_on_this_split_through_its_registered_model(live, case):
    info, model_cfg, objective_cfg, tokenizer = CASES[case]
    torch.manual_seed(0)  # the network tests/registered.py registered
    network = build_model(model_cfg, info).eval()
    goal = objectives.of(objective_cfg)
    direct = same_split.scores(network, _split(case), goal, ObjectiveContext(info, tokenizer_json=tokenizer))
    scored = _score(case)
    assert scored.unscored == "" and set(scored.scored) == set(direct)
    for metric, value in direct.items():  # served through ONNX Runtime: float32 apart at most
        assert scored.scored[metric] == pytest.approx(value, rel=1e-4, abs=1e-5), metric
    assert list(scored.scored)[0] == next(iter(goal.metrics))  # the objective's own metrics first
    # The gate compares both on this split, and the summary says where the numbers come from.
    metric = next(iter(goal.metrics))
    gates = GatesConfig(gates=[GateConfig("beats_champion", {"metric": metric})])
    judgment = gating.judge(gates, {metric: scored.scored[metric]}, scored, "b" * 64)
    verdict = judgment.verdicts[0]
    assert not verdict.passed and "both on this run's test split: not better strictly" in verdict.reason  # a tie
    assert judgment.test_data.startswith("this run's test split (bbbbbbbbbbbb): champion v1 was scored on it")
    assert "the metrics it recorded are from its own test split (aaaaaaaaaaaa)" in judgment.test_data


def test_the_recorded_metrics_are_not_what_is_compared(live):
    """The champion recorded 0.99 on its own split; on this one its registered model scores what
    its network scores, and that is the number the candidate has to beat."""
    scored = _score("table")
    gates = GatesConfig(gates=[GateConfig("beats_champion")])
    judgment = gating.judge(gates, {"accuracy": scored.scored["accuracy"] + 0.01}, scored, "b" * 64)
    assert judgment.passed and f"vs champion v1 {scored.scored['accuracy']:.4f}, both on" in judgment.verdicts[0].reason


def test_a_champion_of_another_kind_or_tokenizer_is_not_scored(live):
    other = _score("table", info=PIXELS)  # this run's data: images; the champion takes 64 features
    assert other.scored == {} and other.unscored.startswith("it takes 64 float features (pixel_0")
    assert "this run's model uint8[1, 8, 8] (classification)" in other.unscored
    replaced = _score("table", info=PIXELS, replace_kind=True)  # the explicit choice
    assert replaced.scored == {} and replaced.other_kind.startswith("64 float features")
    verdict = gating.judge(GatesConfig(gates=[GateConfig("beats_champion")]), {"accuracy": 0.5}, replaced).verdicts[0]
    assert verdict.passed and "another kind of model, replaced (mlflow.replace_kind)" in verdict.reason
    from flyscale.data.text import train_bpe

    retrained = train_bpe(["some text of this run's own, " * 20], 300, 2).to_json()  # another tokenizer
    text = _score("text", tokenizer=retrained)
    assert "its tokenizer is not this run's" in text.unscored


@pytest.mark.parametrize(
    "unscorable, passed, says",
    [
        (
            "fail",
            False,
            "could not be scored on this run's test split (the summary's test data line says why): failing closed",
        ),
        ("recorded", False, "vs champion v1 0.9900, the champion's as recorded, on OTHER test data: not better"),
        ("pass", True, "passed, as unscorable: pass says"),
    ],
)
def test_a_champion_that_cannot_be_scored_fails_closed_or_as_the_gate_says(live, unscorable, passed, says):
    client = MlflowClient(live)
    if not client.search_registered_models("name='not-flyscale'"):
        client.create_registered_model("not-flyscale")
        client.create_model_version("not-flyscale", "runs:/0123456789abcdef/m", None)  # someone else's, no model there
    ref = _score("table", champion="not-flyscale")
    assert ref.scored == {} and "not a flyscale model" in ref.unscored
    gates = GatesConfig(gates=[GateConfig("beats_champion", {"unscorable": unscorable})])
    judgment = gating.judge(gates, {"accuracy": 0.95}, ref, "b" * 64)
    assert judgment.passed is passed and says in judgment.verdicts[0].reason, judgment.verdicts[0].reason
    assert judgment.test_data.startswith("champion v1 could not be scored on this run's test split (bbbbbbbbbbbb)")
    assert "not a flyscale model" in judgment.test_data


def test_unscorable_is_validated():
    with pytest.raises(ValueError, match=r"unscorable must be one of \['fail', 'recorded', 'pass'\], got 'maybe'"):
        GateConfig("beats_champion", {"unscorable": "maybe"})


def test_another_kind_is_refused_naming_both_kinds_and_the_option(live):
    cfg = MlflowConfig(model_name="flyscale-digits", retries=0)
    kind.check(cfg, ModelKind.of(DIGITS, "classification"))  # the same kind: registered as ever
    with pytest.raises(ValueError) as refused:
        kind.check(cfg, ModelKind.of(IMAGES, "classification"), "flyscale-image-folder")
    message = str(refused.value)
    assert "its 'champion' v1 takes 64 float features (pixel_0" in message
    assert "this run's model would take uint8[3, 32, 32] (classification)" in message
    assert "(mlflow.model_name: flyscale-image-folder)" in message and "mlflow.replace_kind: true" in message
    assert message.endswith("Nothing was read or trained yet")
    # The explicit choice: registered under the name, to replace the kind.
    kind.check(MlflowConfig(model_name="flyscale-digits", replace_kind=True), ModelKind.of(IMAGES, "classification"))
    # Another name holds nothing yet: anything goes.
    kind.check(MlflowConfig(model_name="flyscale-image-folder"), ModelKind.of(IMAGES, "classification"))


def test_a_versions_kind_is_read_from_its_tag_before_its_spec(live):
    client = MlflowClient(live)
    version, found = kind.registered(client, "flyscale-digits", "champion")
    assert str(version.version) == "1" and found == ModelKind.of(DIGITS, "classification")  # from the spec
    client.set_model_version_tag(
        "flyscale-digits", "1", kind.KIND_TAG, ModelKind.of(IMAGES, "classification").to_json()
    )
    try:
        assert kind.registered(client, "flyscale-digits", "champion")[1] == ModelKind.of(IMAGES, "classification")
    finally:
        client.delete_model_version_tag("flyscale-digits", "1", kind.KIND_TAG)
