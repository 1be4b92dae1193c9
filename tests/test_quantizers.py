"""Quantizers on real trained models: ONNX Runtime's int8 of the exported file (the default
`dynamic_int8`, and `static_int8` calibrated, QDQ), torch.ao's deprecated static int8, and the
interface around them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn import quantized as nnq

from flyscale import model as artifacts
from flyscale.config import DataConfig, ModelConfig, QuantizeConfig
from flyscale.data import source as data
from flyscale.data.prepare import prepare_table, prepared_frames
from flyscale.data.tensors import to_tensors
from flyscale.evaluate.metrics import evaluate
from flyscale.evaluate.quantize import quantize, quantize_onnx, rebuild_quantized
from flyscale.export import onnx
from flyscale.plugin import registry
from flyscale.plugin.registry import PluginContractError
from flyscale.train.batches import train_data

pytestmark = pytest.mark.timeout(120)

CNN = ModelConfig(name="cnn", options={"channels": [16, 32], "hidden": 128})
STATIC = QuantizeConfig(name="torch_static_int8")
# Measured over seeds 0-3 (5 MLP / 3 CNN epochs, 360 test rows): the largest drop was 0.0083
# (3 rows), most were 0 or one row. 0.02 leaves margin and still catches a broken calibration
# (uncalibrated or mis-scaled int8 loses tens of points).
MAX_DROP = 0.02
# Digits' features are integers 0..16, which even an uncalibrated scale of 1.0 quantizes exactly,
# so accuracy alone hardly notices a calibration that never ran. The logits do: measured
# |int8 - fp32| / |fp32| over the test split was 0.015-0.017 calibrated (8-bit weights, a CPU with
# VNNI), 0.06-0.18 calibrated on one row, 0.7 on random normal data, 0.9 on data scaled down 20x.
# On a CPU with AVX2 only, 8-bit weights saturate ONNX Runtime's kernel: 0.08 (MLP) and 0.10 (CNN)
# static, 0.03 dynamic; the 7-bit weights of the default reduce_range: 0.010, 0.010 and 0.008.
MAX_LOGIT_ERROR = 0.04


@pytest.fixture(scope="module")
def digits():
    frame, info = data.load(DataConfig())
    train, val, test = prepared_frames(prepare_table(frame, DataConfig(), info))
    return train_data(train, val, info), to_tensors(test, info), info


def _calibration(d) -> list[torch.Tensor]:
    """What the quantize task passes: the first training rows, in batches of 64."""
    return list(d.x_train[:512].split(64))


def _trained(cfg: ModelConfig, epochs: int, digits) -> nn.Module:
    d, _, info = digits
    torch.manual_seed(0)
    model = artifacts.build_model(cfg, info)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(d.y_train), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(d.x_train[idx]), d.y_train[idx]).backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def mlp(digits):
    model = _trained(ModelConfig(), 5, digits)
    return model, quantize(model, STATIC, _calibration(digits[0]))


@pytest.fixture(scope="module")
def cnn(digits):
    model = _trained(CNN, 3, digits)
    return model, quantize(model, STATIC, _calibration(digits[0]))


@pytest.mark.parametrize("which,name", [("mlp", "dynamic_int8"), ("mlp", "static_int8"), ("cnn", "static_int8")])
@pytest.mark.slow
def test_onnx_runtime_int8_of_the_export_costs_little_accuracy(which, name, request, digits, tmp_path):
    model, _ = request.getfixturevalue(which)
    d, (x, y), info = digits
    fp32 = onnx.OnnxModule(onnx.export(model, x[:4], tmp_path / "model.onnx"))
    cfg = QuantizeConfig(name=name)
    calibration = [b.numpy() for b in _calibration(d)] if name == "static_int8" else None
    int8 = onnx.OnnxModule(quantize_onnx(fp32.path, cfg, calibration))
    a, b = evaluate(fp32, x, y, info.num_classes), evaluate(int8, x, y, info.num_classes)
    assert a.accuracy > 0.9 and a.accuracy - b.accuracy <= MAX_DROP, (a.accuracy, b.accuracy)
    error = float((int8(x) - fp32(x)).norm() / fp32(x).norm())
    assert 0 < error < MAX_LOGIT_ERROR, error  # int8 arithmetic, calibrated: not the fp32 file again
    assert int8.size_bytes() < fp32.size_bytes() / 3
    ops = {n.op_type for n in __import__("onnx").load(str(int8.path)).graph.node}
    # static: QDQ pairs around int8 weights and activations; dynamic: integer matmuls, convs fp32
    assert ({"QuantizeLinear", "DequantizeLinear"} <= ops) if name == "static_int8" else ("MatMulInteger" in ops)


def test_onnx_static_int8_calibrates_on_the_data_it_is_given(mlp, digits, tmp_path):
    model, _ = mlp
    d, (x, _), _ = digits
    fp32 = onnx.OnnxModule(onnx.export(model, x[:4], tmp_path / "model.onnx"))
    cfg = QuantizeConfig(name="static_int8")
    good = onnx.OnnxModule(quantize_onnx(fp32.path, cfg, [b.numpy() for b in _calibration(d)]))
    wrong = onnx.OnnxModule(quantize_onnx(fp32.path, cfg, [(b / 20).numpy() for b in _calibration(d)]))
    errors = [float((m(x) - fp32(x)).norm() / fp32(x).norm()) for m in (good, wrong)]
    assert errors[0] * 3 < errors[1], errors  # ranges from data scaled down 20x clip every activation
    with pytest.raises(ValueError, match="'static_int8' calibrates on data"):
        quantize_onnx(fp32.path, cfg, None)
    with pytest.raises(ValueError, match="quantizes the exported ONNX file"):
        quantize(model, cfg)


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_static_int8_costs_little_accuracy(which, request, digits):
    model, qmodel = request.getfixturevalue(which)
    _, (x, y), info = digits
    fp32, int8 = evaluate(model, x, y, info.num_classes), evaluate(qmodel, x, y, info.num_classes)
    assert fp32.accuracy > 0.9  # trained, so a drop means something
    assert fp32.accuracy - int8.accuracy <= MAX_DROP, (fp32.accuracy, int8.accuracy)
    with torch.no_grad():
        reference = model(x)
        error = float((qmodel(x) - reference).norm() / reference.norm())
    assert error < MAX_LOGIT_ERROR, error
    assert int8.size_bytes < fp32.size_bytes / 3  # int8 weights, not fp32 ones with observers


def test_static_int8_runs_conv_and_linear_as_int8_modules(cnn, digits):
    model, qmodel = cnn
    convs = [m for m in qmodel.modules() if isinstance(m, nnq.Conv2d)]
    linears = [m for m in qmodel.modules() if isinstance(m, nnq.Linear)]
    assert len(convs) == 2 and len(linears) == 2, qmodel
    assert all(m.weight().dtype == torch.qint8 for m in [*convs, *linears])
    assert not any(type(m) in (nn.Conv2d, nn.Linear) for m in qmodel.modules())  # nothing left in fp32
    # The trained float model is untouched.
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 2
    x = digits[1][0][:4]
    assert model(x).dtype == torch.float32 and qmodel(x).dtype == torch.float32  # int8 inside, float at the edges


@pytest.mark.parametrize("which,cfg", [("mlp", ModelConfig()), ("cnn", CNN)])
def test_a_state_dict_restores_the_quantized_model_exactly(which, cfg, request, digits):
    _, qmodel = request.getfixturevalue(which)
    _, (x, _), info = digits
    path = artifacts.save_state(qmodel, "model_int8.pt")
    fresh = rebuild_quantized(artifacts.build_model(cfg, info), STATIC, info)
    assert not torch.equal(fresh(x), qmodel(x))  # before loading: synthetic scales, random weights
    restored = artifacts.load_state(fresh, path)  # torch.load(weights_only=True)
    assert torch.equal(restored(x), qmodel(x))


def test_rebuild_quantized_serves_a_quantizer_that_does_not_calibrate(mlp, digits):
    model, _ = mlp
    _, (x, _), info = digits
    dynamic = QuantizeConfig(name="torch_dynamic_int8")
    qmodel = quantize(model, dynamic)
    path = artifacts.save_state(qmodel, "model_int8.pt")
    fresh = rebuild_quantized(artifacts.build_model(ModelConfig(), info), dynamic, info)
    restored = artifacts.load_state(fresh, path)
    assert torch.equal(restored(x), qmodel(x))


def _tiny(info) -> nn.Module:
    torch.manual_seed(0)
    return artifacts.build_model(ModelConfig(options={"hidden": [8]}), info).eval()


@pytest.mark.parametrize("calibration", [None, []])
def test_static_int8_without_calibration_is_a_clear_error(calibration, digits):
    with pytest.raises(ValueError, match=r"quantizer 'torch_static_int8' calibrates on data: pass calibration"):
        quantize(_tiny(digits[2]), STATIC, calibration)
    with pytest.raises(ValueError, match=r"static_int8 needs calibration"):  # the plugin, called directly
        STATIC.plugin.plugin.quantize(_tiny(digits[2]), None, [torch.ones(2, 64, dtype=torch.int64)])


class _Halves:
    """A third-party quantizer of the original shape: quantize(model, options), nothing else."""

    options_type = None

    def __init__(self):
        self.calls = []

    def quantize(self, model, options):
        self.calls.append((model, options))
        return model.half()


@pytest.fixture
def register():
    added = []

    def add(name, plugin):
        added.append(name)
        return registry.quantizers.register(name, plugin)

    yield add
    for name in added:
        registry.quantizers.unregister(name)


def test_a_two_argument_quantizer_still_works_through_flyscale(register, digits):
    plugin = register("acme_halves", _Halves())
    model = _tiny(digits[2])
    # The quantize task passes calibration to every quantizer; one that does not calibrate never sees it.
    out = quantize(model, QuantizeConfig(name="acme_halves"), _calibration(digits[0]))
    assert plugin.calls == [(model, None)]
    assert next(out.parameters()).dtype == torch.float16
    quantize(_tiny(digits[2]), QuantizeConfig(name="acme_halves"))  # and without calibration
    assert len(plugin.calls) == 2


def test_a_calibrating_quantizer_must_take_the_calibration(register):
    class Forgets:
        options_type = None
        calibrates = True

        def quantize(self, model, options):
            return model

    with pytest.raises(PluginContractError) as err:
        register("acme_forgets", Forgets())
    expected = "has quantize(model, options), not quantize(model, options, calibration) (it sets calibrates = True)"
    assert expected in str(err.value)

    class Takes(Forgets):
        def quantize(self, model, options, calibration):
            return model

    assert registry.contract_problems("quantizers", Takes()) == []

    # The same 3-argument method without calibrates = True would be called with two: refused too.
    class Undeclared(Takes):
        calibrates = False

    assert registry.contract_problems("quantizers", Undeclared()) == [
        "has quantize(model, options, calibration), not quantize(model, options)"
    ]


class InitOnly(nn.Linear):
    """A Linear that changes only how its weight starts (as gpt's does): nn.Linear's forward."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, 0.02)
        nn.init.zeros_(self.bias)


class OwnForward(nn.Linear):
    """A Linear with a forward of its own: not nn.Linear's arithmetic, so left as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_dynamic_int8_quantizes_linear_subclasses_that_keep_its_forward():
    torch.manual_seed(0)
    model = nn.Sequential(InitOnly(16, 32), nn.ReLU(), nn.Sequential(InitOnly(32, 8)), OwnForward(8, 4))
    x = torch.randn(5, 16)
    q = registry.quantizers.get("torch_dynamic_int8").quantize(model, None)
    assert isinstance(q[0], torch.ao.nn.quantized.dynamic.Linear)
    assert isinstance(q[2][0], torch.ao.nn.quantized.dynamic.Linear)  # nested too
    assert type(q[3]) is OwnForward  # its forward is its own: quantizing it would change what it computes
    assert type(model[0]) is InitOnly and type(model[2][0]) is InitOnly  # the caller's model is untouched
    assert torch.allclose(q(x), model(x), atol=0.05)
    # What a registered int8 model is rebuilt from: the same structure, so its state_dict loads.
    rebuilt = rebuild_quantized(model, QuantizeConfig(name="torch_dynamic_int8"), None)
    rebuilt.load_state_dict(q.state_dict())
    assert torch.equal(rebuilt(x), q(x))
