"""ONNX export (flyscale/export/onnx.py): the MLP, the CNN and the GPT export with a dynamic batch
(and sequence) dimension and answer as PyTorch does; an export that answers differently fails
naming the example; a model torch cannot export is named with torch's reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flyscale.api import DatasetInfo, FieldSpec
from flyscale.config import ModelConfig
from flyscale.export import onnx
from flyscale.model import build_model
from flyscale.plugin import registry

TABLE = DatasetInfo("digits", 10, [64], [f"p{i}" for i in range(64)])
IMAGES = DatasetInfo("digits", 10, [1, 8, 8], [f"p{i}" for i in range(64)])
TOKENS = DatasetInfo(
    "tokens",
    0,
    [17],
    [],
    label_column="",
    fields=[FieldSpec("tokens", "int32", [17], range=[0, 16])],
    input_field="tokens",
)


def _split(x: torch.Tensor, rows: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    y = torch.zeros(len(x), dtype=torch.long)
    return [(x[i : i + rows], y[i : i + rows]) for i in range(0, len(x), rows)]


CASES = {
    "mlp": (TABLE, {}, torch.randn(40, 64), None),
    "cnn": (IMAGES, {}, torch.randn(40, 64), None),
    "gpt": (TOKENS, {"layers": 1, "heads": 2, "width": 32}, torch.randint(0, 17, (40, 17)), "language_modeling"),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_each_built_in_model_exports_and_answers_as_pytorch_at_any_batch_size(name, tmp_path):
    info, options, x, objective_name = CASES[name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name, options=options), info).eval()
    objective = registry.objectives.get(objective_name) if objective_name else None
    split = _split(x)
    path = onnx.export(model, onnx.model_inputs(*split[0], objective)[:4], tmp_path / "model.onnx")
    empty = (x[:0], torch.zeros(0, dtype=torch.long))  # a shard with none of the split's rows
    parity = onnx.check_parity(model, path, [empty, *split], objective)  # batches of 16, then 8: not the traced 4
    assert parity.examples == 40 and parity.same_prediction and parity.max_abs_diff < 1e-4
    if name == "gpt":  # a shorter prompt than the one traced: the sequence dimension is dynamic too
        ids = x[:3, :5]
        got = onnx.session(path).run(None, {"input": ids.numpy()})[0]
        np.testing.assert_allclose(got, model(ids).detach().numpy(), atol=1e-4)


def test_an_export_that_answers_differently_fails_naming_the_example(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(), TABLE).eval()
    x = torch.randn(24, 64)
    path = onnx.export(model, x[:4], tmp_path / "model.onnx")
    with torch.no_grad():
        model[-1].bias[3] += 0.5  # the PyTorch model moves on; the file does not
    with pytest.raises(onnx.ExportError, match=r"does not answer like the PyTorch model: example \d+ "):
        onnx.check_parity(model, path, _split(x), None)


def test_a_tie_broken_the_other_way_by_float_noise_is_a_near_tie_not_another_answer(tmp_path):
    """A language model at random weights has positions whose top two scores differ by less than
    float noise: the export may pick the other one. That is the same answer, counted and said;
    a choice PyTorch scores clearly lower still fails."""
    x = torch.randn(24, 4)
    tied = nn.Linear(4, 3)
    with torch.no_grad():
        tied.weight.zero_()
        tied.bias.copy_(torch.tensor([1.0, 1.0 + 1e-6, -1.0]))  # class 1 wins by 1e-6 in the file
    path = onnx.export(tied, x[:4], tmp_path / "model.onnx")
    with torch.no_grad():
        tied.bias.copy_(torch.tensor([1.0 + 1e-6, 1.0, -1.0]))  # and class 0 by 1e-6 in PyTorch
    parity = onnx.check_parity(tied, path, _split(x), None)
    assert parity.same_prediction and parity.ties == 24
    assert parity.sentence().endswith(
        "the same prediction on every one but 24 near-ties (top two scores within twice the tolerance)"
    )
    with torch.no_grad():
        tied.bias[0] += 1e-3  # now PyTorch clearly prefers class 0: a different answer
    with pytest.raises(onnx.ExportError, match="example 0 is predicted differently"):
        onnx.check_parity(tied, path, _split(x), None)


class Branchy(nn.Module):
    """Control flow on the data's values: torch.export cannot trace it without torch.cond."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class Cummax(nn.Module):
    """An operator ONNX has no function for, inside a submodule."""

    def forward(self, x):
        return torch.cummax(x, dim=1).values


def test_a_model_onnx_cannot_take_fails_naming_the_operator_or_the_line_and_the_fallback(tmp_path):
    with pytest.raises(onnx.ExportError) as untraced:
        onnx.export(Branchy(), torch.randn(4, 64), tmp_path / "model.onnx")
    said = str(untraced.value)
    assert said.startswith("the Branchy could not be exported to ONNX by torch.onnx.export(dynamo=True): ")
    assert "Could not guard on data-dependent expression" in said and "(in Branchy.forward, test_export.py:" in said
    assert "set export.fallback: torch to register the PyTorch model" in said and "\n" not in said

    nested = nn.Sequential(nn.Linear(64, 8), nn.Sequential(nn.ReLU(), Cummax()))
    with pytest.raises(
        onnx.ExportError, match=r"ONNX has no function for the operator aten\.cummax \(in the Cummax at 1\.1\)"
    ):
        onnx.export(nested.eval(), torch.randn(4, 64), tmp_path / "model.onnx")
