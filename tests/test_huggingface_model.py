"""The Hugging Face model plugin (plugins/huggingface.py) on small random checkpoints made offline
by `flyscale tiny-checkpoint`'s code: the checkpoint's weights are what training starts from and
answer as transformers does; the model materialises from the meta device and fsdp shards its
decoder layers; labels, vocabularies, tokenizers and strategies that do not fit are refused
before any data work, naming both sides. (tests/test_huggingface_e2e.py fine-tunes one through
`pyflyte run`.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TokenizeConfig, TrainConfig
from flyscale.data import text
from flyscale.data.tokenize import check_tokenizer, planned_info
from flyscale.export import tiny_checkpoint
from flyscale.export.onnx_pyfunc.generation import tokens_of
from flyscale.model import build_model, kept, parameter_counts
from flyscale.tracking import start
from flyscale.train import meta, trainer
from flyscale.train.checkpoint import Checkpointer
from flyscale.train.checkpoint_files import complete_checkpoints
from flyscale.train.distributed import DistContext
from flyscale.train.loop import Hooks
from flyscale.train.state import Position, TrainState
from flyscale.train.step import make_optimizer
from flyscale.train.strategies import check_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": tiny_checkpoint.make("llama", root / "llama"),
        "llama-other": tiny_checkpoint.make("llama", root / "llama-other", seed=1),
        "bert": tiny_checkpoint.make("bert", root / "bert", labels=3),
        "vit": tiny_checkpoint.make("vit", root / "vit", labels=4, image_size=16),
    }


def _tokens(length: int = 33, vocab: int = 257) -> DatasetInfo:
    field = FieldSpec("tokens", "int32", [length], range=[0, vocab - 1])
    return DatasetInfo("tokens", 0, [length], [], label_column="", fields=[field], input_field="tokens")


def _labelled_tokens(classes: int) -> DatasetInfo:
    fields = [FieldSpec("tokens", "int32", [16], range=[0, 256]), FieldSpec("label", "int64", [])]
    return DatasetInfo("reviews", classes, [16], [], label_column="label", fields=fields, input_field="tokens")


def _documents() -> DatasetInfo:
    fields = [FieldSpec("text", "string", [])]
    return DatasetInfo("docs", 0, [], [], label_column="", fields=fields, input_field="text")


def _model(path: Path, **more) -> ModelConfig:
    return ModelConfig(name="huggingface", options={"path": str(path)}, **more)


def _started(cfg: ModelConfig, info: DatasetInfo, tmp_path: Path) -> torch.nn.Module:
    """The model as training starts it: built, then given the weights flyscale fetched for it."""
    fetched = start.starting_weights(cfg, build_model(cfg, info, meta=True), info, lambda: tmp_path, lambda: "")
    assert fetched is not None
    model = build_model(cfg, info)
    model.load_state_dict(torch.load(fetched.weights_path, weights_only=True))
    return model.eval()


def test_a_causal_lm_starts_from_its_checkpoint_and_answers_as_transformers(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    info = _tokens()
    model = _started(_model(checkpoints["llama"]), info, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    ids = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_model_init_from_names_another_checkpoint_of_the_same_architecture(checkpoints, tmp_path):
    info = _tokens()
    base = _started(_model(checkpoints["llama"]), info, tmp_path / "a")
    other = _started(_model(checkpoints["llama"], init_from=str(checkpoints["llama-other"])), info, tmp_path / "b")
    name = "hf.model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base.state_dict()[name], other.state_dict()[name])
    with pytest.raises(ValueError, match="model.init_from must be models:/NAME@ALIAS"):
        _model(checkpoints["llama"], init_from="s3://bucket/weights")
    with pytest.raises(start.StartError, match="is another architecture than this run builds"):
        _started(_model(checkpoints["llama"], init_from=str(checkpoints["bert"])), info, tmp_path / "c")


def test_on_the_meta_device_it_materialises_and_fsdp_shards_each_decoder_layer(checkpoints):
    from flyscale_plugins.strategies.fsdp import FSDPOptions, units_of

    info = _tokens()
    cfg = _model(checkpoints["llama"])
    on_meta = build_model(cfg, info, meta=True)
    meta.check_materialisable(on_meta)  # norms and rotary frequencies initialise by the model's own rules
    materialised = meta.materialise(on_meta, "cpu", seed=0)
    in_memory = build_model(cfg, info)
    for name, buffer in in_memory.named_buffers():  # computed, not learnt: not in any checkpoint
        torch.testing.assert_close(materialised.get_buffer(name), buffer)
    assert [type(u).__name__ for u in units_of(on_meta, FSDPOptions())] == ["LlamaDecoderLayer"] * 2


def test_strategies_that_cannot_split_it_refuse_before_any_data_work(checkpoints):
    model = build_model(_model(checkpoints["llama"]), _tokens(), meta=True)
    with pytest.raises(ValueError, match="needs an nn.Sequential, and this one is a HuggingFaceModel"):
        check_model(model, TrainConfig(strategy="pipeline"), 2)
    with pytest.raises(ValueError, match="splits only nn.Linear layers, colwise or rowwise"):
        check_model(model, TrainConfig(strategy="hybrid", options={"mesh": {"dp": 1, "tp": 2}}), 2)
    check_model(model, TrainConfig(strategy="fsdp"), 2)


def test_activation_checkpointing_recomputes_each_decoder_layer_with_the_same_gradients(checkpoints, tmp_path):
    from flyscale.train.step import enable_activation_checkpointing

    info, cfg = _tokens(), _model(checkpoints["llama"])
    check_model(build_model(cfg, info, meta=True), TrainConfig(activation_checkpointing=True), 2)
    ids = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))

    def gradients(checkpointed: bool) -> tuple[dict[str, torch.Tensor], int]:
        model = _started(cfg, info, tmp_path).train()
        if checkpointed:
            enable_activation_checkpointing(model)
        calls = 0

        def count(*_):
            nonlocal calls
            calls += 1

        for layer in model.modules():  # a part of each layer: the recompute calls the layer's own forward
            if type(layer).__name__ == "LlamaDecoderLayer":
                layer.mlp.register_forward_pre_hook(count)
        model(ids).logsumexp(-1).mean().backward()
        return {n: p.grad for n, p in model.named_parameters()}, calls

    plain, plain_calls = gradients(False)
    recomputed, recomputed_calls = gradients(True)
    assert (plain_calls, recomputed_calls) == (2, 4)  # each of the 2 layers run again in backward
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, msg=name)


def test_labels_vocabularies_and_positions_that_do_not_fit_are_refused_naming_both(checkpoints):
    with pytest.raises(
        ValueError, match=r"has 3 labels \(LABEL_0, LABEL_1, LABEL_2\); dataset 'reviews' has 10 classes"
    ):
        build_model(_model(checkpoints["bert"]), _labelled_tokens(10), meta=True)
    assert build_model(_model(checkpoints["bert"]), _labelled_tokens(3))(
        torch.zeros(2, 16, dtype=torch.long)
    ).shape == (2, 3)
    with pytest.raises(ValueError, match=r"embeds 257 token ids, but dataset 'tokens'.s ids reach 1023"):
        build_model(_model(checkpoints["llama"]), _tokens(vocab=1024), meta=True)
    with pytest.raises(ValueError, match="has 256 positions; dataset 'tokens'.s sequences are 300 tokens long"):
        build_model(_model(checkpoints["llama"]), _tokens(length=300), meta=True)
    image = DatasetInfo(
        "shapes", 4, [3, 16, 16], [], fields=[FieldSpec("image", "float32", [3, 16, 16])], input_field="image"
    )
    assert build_model(_model(checkpoints["vit"]), image)(torch.zeros(2, 3, 16, 16)).shape == (2, 4)
    small = DatasetInfo(
        "shapes", 4, [3, 8, 8], [], fields=[FieldSpec("image", "float32", [3, 8, 8])], input_field="image"
    )
    with pytest.raises(ValueError, match="takes 3x16x16 images; dataset 'shapes'.s are 3x8x8"):
        build_model(_model(checkpoints["vit"]), small, meta=True)


def test_a_classifier_attends_to_every_position_but_the_padding(checkpoints):
    """A labelled document's row ends in the pad id (256, the checkpoint's pad_token_id): the
    class scores are those of the document alone, whatever the padding; the tokenizer pads with it."""
    model = build_model(_model(checkpoints["bert"]), _labelled_tokens(3)).eval()
    ids = torch.tensor([[104, 105, 33, 10, 200]])
    padded = torch.cat([ids, torch.full((1, 11), 256)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded), model(ids), rtol=0, atol=1e-5)
    assert text.load_pretrained(str(checkpoints["bert"])).pad == 256


def test_digit_tokens_are_the_digits_pixels_as_ids_which_a_bert_of_10_labels_reads(tmp_path):
    """docs/huggingface.md's `digit_tokens`: each image's 64 intensities as ids 0-16, its digit the
    label, every example valid as declared; a BERT saved with 10 labels classifies its rows, and an
    MLP, which cannot embed ids, is refused before any data work."""
    import pyarrow as pa
    from sklearn.datasets import load_digits

    from flyscale.data import example_checks
    from flyscale_plugins.sklearn_data import digit_tokens

    info = digit_tokens.info(None)
    (batch,) = digit_tokens.examples(None, "")
    digits = load_digits()
    assert batch.column("tokens").to_pylist() == digits.data.astype(int).tolist()
    assert batch.column("label").to_pylist() == digits.target.tolist()
    checked = example_checks.check_batch(pa.Table.from_batches([batch]), info, "digits")
    assert len(checked.reasons) == len(digits.target) and not checked.bad.any()
    bert = tiny_checkpoint.make("bert", tmp_path / "bert", labels=10, width=16, layers=1)
    rows = torch.tensor(digits.data[:4].astype("int64"))
    assert build_model(_model(bert), info)(rows).shape == (4, 10)
    with pytest.raises(ValueError, match=r"model 'mlp' reads numbers, and dataset 'digit_tokens'.s input is token ids"):
        build_model(ModelConfig(name="mlp"), info, meta=True)


def test_the_checkpoints_tokenizer_makes_the_ids_and_the_served_model_reads_them_alike(checkpoints):
    cfg = _model(checkpoints["llama"])
    with pytest.raises(
        ValueError, match=rf"tokenize.tokenizer is 'byte': set tokenize.tokenizer: {checkpoints['llama']}"
    ):
        check_tokenizer(_documents(), TokenizeConfig(tokenizer="byte"), cfg)
    own = TokenizeConfig(tokenizer=str(checkpoints["llama"]), seq_len=33)
    check_tokenizer(_documents(), own, cfg)
    assert planned_info(_documents(), own).input().range == [0, 256]

    tok = text.load_pretrained(str(checkpoints["llama"]))
    assert (tok.name, tok.vocab_size, tok.eot) == ("pretrained", 257, 256)
    sample = ["def f(x):\n    return x  # é", "<|endoftext|> is text here"]
    ids = tok.encode_batch(sample)
    saved = tok.to_json()
    again = text.from_json(saved)
    served = tokens_of(saved)
    assert json.loads(saved)["eot"] == served.eot == again.eot == 256
    for s, i in zip(sample, ids):
        assert list(again.encode_batch([s])[0]) == served.encode(s) == list(i)
        assert served.decode(list(i)) == again.decode(i) == s
    assert 256 not in ids[1]  # the special token's text is text: only packing ends a document
    with pytest.raises(ValueError, match="is neither 'byte', 'bpe' nor a Hugging Face checkpoint"):
        text.load_pretrained(str(checkpoints["llama"] / "absent"))


def _lora(path: Path) -> ModelConfig:
    return ModelConfig(name="huggingface", options={"path": str(path), "lora": {"r": 4, "alpha": 8}})


def test_lora_trains_and_checkpoints_only_the_adapters_and_merges_into_a_plain_model(checkpoints, tmp_path):
    """What a LoRA run holds and hands on: the adapters are the only trained weights, the optimizer
    state and each checkpoint hold only them (the frozen model comes back from the starting
    weights), and the kept model is a plain transformers model with the adapters merged in."""
    from torch.distributed.checkpoint import FileSystemReader

    info, cfg = _tokens(), _lora(checkpoints["llama"])
    weights = start.starting_weights(
        cfg, build_model(cfg, info, meta=True), info, lambda: tmp_path / "start", lambda: ""
    )
    assert weights is not None

    def built() -> TrainState:
        model = build_model(cfg, info)
        return TrainState(model, make_optimizer(model, TrainConfig(lr=0.05)))

    state = built()
    state.load_start(weights.weights_path)
    total, trained = parameter_counts(state.module)
    assert 0 < trained < 0.05 * total
    assert all("lora_" in n for n, p in state.module.named_parameters() if p.requires_grad)
    ids = torch.randint(0, 257, (4, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        state.optimizer.zero_grad()
        logits = state.module(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 257), ids[:, 1:].reshape(-1)).backward()
        state.optimizer.step()
    assert sum(p.numel() for g in state.optimizer.param_groups for p in g["params"]) == trained
    assert sum(s["exp_avg"].numel() for s in state.optimizer.state.values()) == trained

    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=1)
    ckpt.save(state, Position(step=2), DistContext(), "fsdp")
    saved = FileSystemReader(str(complete_checkpoints(ckpt.root)[-1] / "state")).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    # A fresh attempt as training starts one: the starting weights, then the checkpoint over them.
    again = built()
    resumed = trainer._Run(
        TrainConfig(), DistContext(), "fsdp", again, Hooks(checkpointer=ckpt, start=weights.weights_path)
    )
    resumed.start(steps_per_epoch=10)
    assert resumed.history.resumed_from_step == 2
    for (name, a), b in zip(state.module.state_dict().items(), again.module.state_dict().values()):
        assert torch.equal(a, b), name

    path = str(tmp_path / "trained.pt")
    torch.save(state.module.state_dict(), path)
    kept_cfg, kept_path = kept(cfg, info, path)
    assert kept_cfg.options["lora"] is None
    plain = build_model(kept_cfg, info)
    plain.load_state_dict(torch.load(kept_path, weights_only=True))
    assert not any("lora" in k for k in plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ids), state.module.eval()(ids), rtol=0, atol=1e-5)


def test_a_registered_spec_rebuilds_the_model_without_the_checkpoints_folder(tmp_path):
    import shutil

    from flyscale.model import save_state
    from flyscale.tracking.model_spec import build, spec_json

    folder = tiny_checkpoint.make("llama", tmp_path / "gone", seed=2)
    info, cfg = _tokens(), _model(folder)
    torch.manual_seed(0)
    model = build_model(cfg, info).eval()
    spec, weights = json.loads(spec_json(cfg, info, None)), save_state(model, "m.pt")
    shutil.rmtree(folder)
    assert spec["model"]["options"]["config"]["model_type"] == "llama"
    rebuilt = build(spec, weights)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids), model(ids), rtol=0, atol=0)
