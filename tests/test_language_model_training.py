"""A GPT trained with the language-modelling objective computes, under each strategy, what one
process computes: DDP at world size 2 against one process with the doubled batch, and the
pipeline strategy's two stages (built on the meta device) against one process; real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig, TrainConfig
from flyscale.model import build_model
from flyscale.plugin import registry
from flyscale.train import meta, trainer
from flyscale.train.batches import TrainData
from flyscale.train.distributed import process_group
from flyscale_plugins.strategies.ddp import DDPOptions, ddp
from flyscale_plugins.strategies.pipeline import PipelineOptions, pipeline
from tests.distributed_helpers import run_on_ranks

VOCAB, SEQ = 17, 17  # the model reads 16 tokens and predicts the 16 after them
INFO = DatasetInfo(
    "tokens",
    0,
    [SEQ],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [SEQ], range=[0, VOCAB - 1])],
    input_field="tokens",
)
B, STEPS = 4, 4  # per-rank batch under DDP; optimizer steps
RTOL, ATOL = 1e-5, 4e-5  # as the strategies' own equivalence tests


def _gpt(tie: bool = True, on_meta: bool = False):
    torch.manual_seed(0)
    options = {"layers": 2, "heads": 2, "width": 32, "tie_embeddings": tie}
    return build_model(ModelConfig(name="gpt", options=options), INFO, meta=on_meta)


def _data(rows: int) -> TrainData:
    g = torch.Generator().manual_seed(1)
    # A learnable stream: each next token is the last plus a small random step, modulo the vocabulary.
    steps = torch.randint(0, 3, (rows + 8, SEQ), generator=g)
    x = torch.cumsum(steps, dim=1) % VOCAB
    empty = torch.zeros(len(x), dtype=torch.long)  # no labels: the objective scores the tokens
    lm = registry.objectives.get("language_modeling")
    return TrainData(x[:rows], empty[:rows], x[rows:], empty[rows:], objective=lm)


def _lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _reference(model, data: TrainData, cfg: TrainConfig, order: torch.Tensor, batch: int) -> dict:
    """A plain loop, as nanoGPT's: the same batches in the same order, AdamW, the next-token loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    for step in range(STEPS):
        idx = order[step * batch : (step + 1) * batch]
        opt.zero_grad()
        _lm_loss(model, data.x_train[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_rank(cfg: TrainConfig):
    with process_group(timeout_s=60) as ctx:
        result = trainer.train(ddp, _gpt(), _data(2 * B * STEPS), cfg, ctx, DDPOptions())
        return {k: v.clone() for k, v in result.model.state_dict().items()}, result.history.epochs[0].val_loss


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_gpt_under_ddp_at_world_size_2_matches_one_process_with_the_doubled_batch():
    cfg = TrainConfig(epochs=1, batch_size=B, lr=1e-2, seed=3)
    (state0, val0), (state1, _) = run_on_ranks(_ddp_rank, 2, cfg)
    order = torch.randperm(2 * B * STEPS, generator=torch.Generator().manual_seed(cfg.seed))  # DistributedSampler's
    reference = _reference(_gpt(), _data(2 * B * STEPS), cfg, order, 2 * B)
    for name, ref in reference.items():
        torch.testing.assert_close(state0[name], ref, rtol=RTOL, atol=ATOL, msg=name)
        torch.testing.assert_close(state1[name], state0[name], rtol=0, atol=0, msg=name)
    assert not torch.allclose(reference["0.tok"], _gpt().state_dict()["0.tok"])  # the weights did move
    # Validation is per token: the mean next-token loss over the validation sequences.
    model = _gpt()
    model.load_state_dict(reference)
    with torch.no_grad():
        assert val0 == pytest.approx(float(_lm_loss(model.eval(), _data(2 * B * STEPS).x_val)), rel=1e-4)


def _pipeline_rank(cfg: TrainConfig, options: PipelineOptions):
    with process_group(timeout_s=60) as ctx:
        result = trainer.train(pipeline, _gpt(tie=False, on_meta=True), _data(B * STEPS), cfg, ctx, options)
        return {k: v.clone() for k, v in result.model.state_dict().items()} if ctx.is_main else None


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_an_untied_gpt_in_two_pipeline_stages_matches_one_process():
    cfg = TrainConfig(strategy="pipeline", epochs=1, batch_size=B, lr=1e-2, seed=3)
    options = PipelineOptions(schedule="1f1b", microbatches=2)
    state, _ = run_on_ranks(_pipeline_rank, 2, cfg, options)
    # The pipeline's loader: every rank the same global batches, shuffled by (seed, epoch).
    order = torch.randperm(B * STEPS, generator=torch.Generator().manual_seed(cfg.seed))
    start = meta.materialise(_gpt(tie=False, on_meta=True), "cpu", cfg.seed)  # the stages' initial weights
    reference = _reference(start, _data(B * STEPS), cfg, order, B)
    assert set(state) == set(reference)
    for name, ref in reference.items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)


def test_the_preflight_of_a_gpt_compares_its_next_token_losses():
    """At world size one, without spawning: the check's own data keeps the objective, so the
    strategy's steps and the reference loop both score next tokens (not one class a sequence)."""
    from flyscale.config import PreflightConfig
    from flyscale.train.distributed import DistContext
    from flyscale.train.preflight import run_preflight

    cfg = TrainConfig(batch_size=B, lr=1e-2)
    report = run_preflight(
        lambda: _gpt(), _data(4 * B), cfg, PreflightConfig(enabled=True, steps=3), DistContext(), ddp, DDPOptions()
    )
    assert report.passed and report.steps == 3 and report.max_rel_diff < 1e-5
    assert report.losses_world1[0] > report.losses_world1[-1]  # it learns: next-token losses, going down
