"""The GPT model plugin: logits for token ids, causal, nanoGPT's size and initialisation, weights
that depend only on the seed (in memory and from the meta device), that it learns a pattern and
continues it, and that the pipeline strategy's check takes it untied."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.train import meta
from flyscale.train.strategies import check_model
from flyscale_plugins.gpt import GPTOptions, generate, gpt

V, T = 10, 16  # token ids 0..9, sequences of 16


def _tokens(name: str = "tiny", vocab: int = V, seq_len: int = T) -> DatasetInfo:
    """What flyscale.data.tokenize.sequences_info declares for packed token sequences."""
    tokens = FieldSpec("tokens", "int32", [seq_len], range=[0, vocab - 1])
    return DatasetInfo(name, 0, [seq_len], [], label_column="", fields=[tokens], input_field="tokens")


TINY = _tokens()
SMALL = dict(layers=2, heads=2, width=32)
PIPELINE = TrainConfig(strategy="pipeline", batch_size=8, options={"microbatches": 2})


@pytest.fixture(autouse=True)
def registered():
    """'gpt' in the model registry, as its entry point will put it."""
    registry.models.register("gpt", gpt)
    yield
    registry.models.unregister("gpt")


def _build(info: DatasetInfo = TINY, **options) -> nn.Sequential:
    return gpt.build(GPTOptions(**{**SMALL, **options}), info)


def _meta(info: DatasetInfo = TINY, **options) -> nn.Module:
    return build_model(ModelConfig(name="gpt", options={**SMALL, **options}), info, meta=True)


def _nanogpt_params(vocab: int, context: int, layers: int, w: int, bias: bool, tied: bool) -> int:
    """Counted from the architecture: embeddings, blocks (q/k/v, attention's projection, the MLP's
    two 4x layers, two LayerNorms), the final LayerNorm, and an untied head."""
    norm = 2 * w if bias else w
    block = 12 * w * w + (3 * w + w + 4 * w + w if bias else 0) + 2 * norm
    return vocab * w + context * w + layers * block + norm + (0 if tied else vocab * w)


def _check_init(model: nn.Sequential, layers: int) -> None:
    """nanoGPT's initialisation: Linear and embedding weights normal(0, 0.02), the two residual
    projections of each block normal(0, 0.02 / sqrt(2 * layers)), biases 0, LayerNorms 1 and 0."""
    residual = 0.02 / math.sqrt(2 * layers)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:  # normal(0, std): the residual projections, or embeddings, q/k/v, MLP in, untied head
            std = residual if name.endswith(("attn.c_proj.weight", "mlp.2.weight")) else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.05), name
            assert abs(p.mean().item()) < 0.1 * std, name


def test_logits_for_every_position_and_each_depends_only_on_the_tokens_before_it():
    model = _build().eval()
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (3, T, V)
    assert model(ids[:, :5]).shape == (3, 5, V)  # shorter than the context
    changed = ids.clone()
    changed[:, 6] = (ids[:, 6] + 1) % V
    after = model(changed)
    torch.testing.assert_close(after[:, :6], logits[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 6:], logits[:, 6:])
    same = model[0](torch.zeros(1, T, dtype=torch.long))  # one token everywhere: only its position differs
    assert not torch.allclose(same[0, 0], same[0, 1])
    with pytest.raises(ValueError, match="17 tokens is longer than the model's context of 16"):
        model(torch.zeros(1, T + 1, dtype=torch.long))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(width=130, heads=4), r"width \(130\) must be divisible by heads \(4\)"),
        (dict(layers=0), "layers must be a whole number >= 1"),
        (dict(context=-1), "context must be"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(width_multiplier=0), "width_multiplier must be a number > 0"),
        (dict(layers=2, depth_multiplier=0.2), "depth_multiplier 0.2 leaves none of the 2 layers"),
    ],
)
def test_options_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        GPTOptions(**options)


def test_multipliers_keep_the_width_a_multiple_of_heads():
    assert GPTOptions(width=128, heads=4, width_multiplier=0.3).sizes() == (4, 40)  # 38.4 -> 10 per head
    assert GPTOptions(width=128, heads=4, width_multiplier=0.001).sizes() == (4, 4)  # at least one per head
    assert GPTOptions(layers=4, depth_multiplier=1.5).sizes() == (6, 128)
    model = _build(heads=4, width=128, width_multiplier=0.3)
    assert model[0].tok.shape == (V, 40) and len(model) == 2 + 2


@pytest.mark.parametrize(
    "info, has",
    [
        (DatasetInfo("digits", 10, [64], [f"p{i}" for i in range(64)]), "a table of 64 features"),
        (
            DatasetInfo(
                "cifar", 10, [3, 8, 8], [], fields=[FieldSpec("image", "uint8", [3, 8, 8])], input_field="image"
            ),
            r"image: uint8\[3, 8, 8\]",
        ),
        (
            DatasetInfo("x", 0, [T], [], fields=[FieldSpec("x", "float32", [T], range=[0, 1])], input_field="x"),
            r"x: float32\[16\] with range \[0, 1\]",
        ),
        (
            DatasetInfo("ids", 0, [T], [], fields=[FieldSpec("ids", "int64", [T])], input_field="ids"),
            r"ids: int64\[16\] with range None",
        ),
    ],
)
def test_inputs_other_than_token_ids_refused_naming_the_dataset(info, has):
    with pytest.raises(ValueError, match=rf"model 'gpt' needs token ids.*dataset {info.name!r} has {has}"):
        _build(info)


def test_a_context_shorter_than_the_sequences_is_refused():
    with pytest.raises(ValueError, match=r"context \(8\) is shorter than the 16-token sequences of dataset 'tiny'"):
        _build(context=8)
    assert _build(context=32)[0].pos.shape == (32, 32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_parameters_as_nanogpt_counts_them_tied_weights_one_parameter(tied, bias):
    model = _build(tie_embeddings=tied, bias=bias, context=24)
    assert sum(p.numel() for p in model.parameters()) == _nanogpt_params(V, 24, 2, 32, bias, tied)
    assert (model[0].tok is model[-1].lm_head.weight) == tied
    assert len(list(model.parameters())) == len(dict(model.named_parameters(remove_duplicate=False))) - tied


def test_initialised_as_nanogpt():
    model = _build(_tokens(vocab=64, seq_len=32), layers=4, heads=4, width=256, bias=True, tie_embeddings=False)
    _check_init(model, layers=4)


def test_seeded_builds_through_the_registry_give_the_same_weights():
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(ModelConfig(name="gpt", options=SMALL), TINY).state_dict()

    first, again, other = weights(3), weights(3), weights(4)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["0.tok"], other["0.tok"])


def test_materialised_from_meta_untied_depends_only_on_the_seed_and_is_initialised():
    wide = dict(layers=4, heads=4, width=128, tie_embeddings=False, bias=True)
    info = _tokens(vocab=256, seq_len=64)
    first, again = (meta.materialise(_meta(info, **wide), "cpu", seed=7) for _ in range(2))
    assert not meta.is_meta(first)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    _check_init(first, layers=4)
    # Each layer's weights depend only on (seed, layer): the last layer alone is the same.
    last = meta.materialise(_meta(info, **wide), "cpu", seed=7, layers=[5])
    assert torch.equal(last[5].lm_head.weight, first[5].lm_head.weight) and meta.is_meta(last[0])
    other = meta.materialise(_meta(info, **wide), "cpu", seed=8)
    assert not torch.equal(other[0].tok, first[0].tok)


def test_tied_builds_on_meta_materialises_tied_and_is_refused_where_layers_go_to_different_stages():
    model = _meta()
    assert model[0].tok is model[-1].lm_head.weight  # the shapes (and the parameter count) are right
    check_model(model, TrainConfig(), 2)  # ddp builds the model in memory, where the tie holds
    # The tie is named, with the way out, before any data is read.
    tied = r"layers 0 \(tok\) and 3 \(lm_head.weight\) share one parameter .*different stages.*tie_embeddings: false"
    with pytest.raises(ValueError, match=tied):
        check_model(model, PIPELINE, 2)
    # Materialised whole, the tie holds, initialised once, by the embedding (layer 0).
    whole = meta.materialise(model, "cpu", seed=0)
    alone = meta.materialise(_meta(), "cpu", seed=0, layers=[0])
    assert whole[0].tok is whole[-1].lm_head.weight and torch.equal(whole[0].tok, alone[0].tok)


def test_the_pipeline_strategy_takes_it_untied():
    check_model(_meta(tie_embeddings=False), PIPELINE, 2)


def test_the_registry_accepts_it_and_config_validates_its_options():
    assert registry.models.get("gpt") is gpt
    assert registry.contract_problems("models", gpt) == []
    with pytest.raises(ValueError, match="divisible by heads"):
        ModelConfig(name="gpt", options={"width": 30, "heads": 4})


PATTERN = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])  # 1 is followed by 4 or 5: only context tells which


@pytest.fixture(scope="module")
def trained() -> tuple[nn.Sequential, list[float]]:
    """A small model after 40 AdamW steps on windows of the pattern repeated; its losses."""
    torch.manual_seed(0)
    model = gpt.build(GPTOptions(**SMALL), TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    corpus, g = PATTERN.repeat(T // len(PATTERN) + 1), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        ids = torch.stack([corpus[s : s + T] for s in torch.randint(0, len(PATTERN), (16,), generator=g)])
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.eval(), losses


def test_it_learns_a_repeating_pattern(trained):
    _, losses = trained
    assert losses[0] > 0.8 * math.log(V)  # chance, at the start
    assert losses[-1] < 0.1 * math.log(V)


def test_greedy_generation_continues_the_pattern_past_the_context(trained):
    model, _ = trained
    out = generate(model, PATTERN[None, :5], max_new_tokens=20, temperature=0)  # 25 tokens > context 16
    assert out.tolist() == [PATTERN.repeat(4)[:25].tolist()]
    a, b = (generate(model, PATTERN[None, :3], 8, 1.0, torch.Generator().manual_seed(1)) for _ in range(2))
    assert torch.equal(a, b) and a.shape == (1, 11) and 0 <= a.min() and a.max() < V
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, PATTERN[None, :3], 1, temperature=-1)
