"""The ResNet model plugin: its shapes for image fields and flat tables of pixels, whole blocks as
layers of a Sequential (for the pipeline strategy and activation checkpointing), weights that
depend only on the seed, and that it learns."""

from __future__ import annotations

import copy
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
from flyscale.train.step import enable_activation_checkpointing
from flyscale.train.strategies import check_model
from flyscale_plugins.models import BasicBlock, ResNetOptions


def _typed(name: str, shape: list[int], classes: int) -> DatasetInfo:
    image = FieldSpec("image", "uint8", shape, "png", [0, 255])
    return DatasetInfo(name, classes, shape, [], fields=[image, FieldSpec("label", "int64", [])], input_field="image")


CIFAR = _typed("cifar-like", [3, 32, 32], 10)
SMALL = _typed("small", [1, 8, 8], 4)
DIGITS = DatasetInfo("digits", 10, [1, 8, 8], [f"pixel_{i}" for i in range(64)])  # a table: arrives flat


def _build(info: DatasetInfo = CIFAR, **options) -> nn.Sequential:
    plugin = registry.models.get("resnet")
    return plugin.build(plugin.options_type(**options), info)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "info, batch", [(CIFAR, (2, 3, 32, 32)), (SMALL, (2, 1, 8, 8)), (DIGITS, (2, 64))], ids=["rgb", "grey", "flat"]
)
def test_one_logit_per_class_for_images_and_flat_tables_of_pixels(info, batch):
    model = _build(info).eval()
    assert model(torch.rand(batch)).shape == (2, info.num_classes)


def test_a_sequential_of_whole_blocks_each_later_stage_halving_the_size():
    model = _build(blocks=[2, 1, 1])
    assert isinstance(model, nn.Sequential)
    kinds = [type(layer).__name__ for layer in model]
    assert kinds == [
        "Conv2d",
        "BatchNorm2d",
        "ReLU",
        *["BasicBlock"] * 4,
        "AdaptiveAvgPool2d",
        "Flatten",
        "Dropout",
        "Linear",
    ]
    blocks = [layer for layer in model if isinstance(layer, BasicBlock)]
    assert not any(isinstance(m, BasicBlock) for b in blocks for m in list(b.modules())[1:])  # none nested
    # Only where the shape changes does the shortcut need a convolution.
    assert [isinstance(b.shortcut, nn.Identity) for b in blocks] == [True, True, False, False]
    features = model[:-4](torch.rand(2, 3, 32, 32))
    assert features.shape == (2, 64, 8, 8)  # 32 -> 16 -> 8 after stages 2 and 3


def test_a_block_adds_its_input_back():
    block = [layer for layer in _build(norm="group") if isinstance(layer, BasicBlock)][0]
    x = torch.randn(2, 16, 8, 8)
    with torch.no_grad():
        block.body[-1].weight.zero_()  # the body's last norm now outputs its bias, 0
        assert torch.equal(block(x), x.relu())
        block.body[-1].bias.fill_(1.0)
        assert torch.equal(block(x), (x + 1).relu())


def test_size_follows_widths_and_the_multipliers():
    small, default = _params(_build(widths=[8, 16, 32])), _params(_build())
    assert small < default < _params(_build(width_multiplier=2))
    deeper = _build(depth_multiplier=2)
    assert sum(isinstance(layer, BasicBlock) for layer in deeper) == 6 and _params(deeper) > default


@pytest.mark.parametrize(
    "options, field",
    [
        ({"widths": []}, "widths"),
        ({"widths": [16, 0]}, "widths"),
        ({"blocks": [1, 1]}, "blocks"),
        ({"blocks": [1, 0, 1]}, "blocks"),
        ({"norm": "layer"}, "norm"),
        ({"dropout": 1.0}, "dropout"),
        ({"width_multiplier": 0}, "width_multiplier"),
        ({"depth_multiplier": 0.4}, "depth_multiplier"),
    ],
)
def test_bad_options_name_the_option(options, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        ResNetOptions(**options)


def test_refuses_inputs_that_are_not_images():
    table = DatasetInfo("wine", 3, [13], [f"f{i}" for i in range(13)])
    with pytest.raises(ValueError, match=r"model 'resnet' needs image inputs \(C, H, W\); dataset 'wine' has \[13\]"):
        _build(table)


def test_group_norm_passes_the_pipeline_strategy_check_and_batch_norm_does_not():
    pipeline = TrainConfig(strategy="pipeline", batch_size=32, options={"microbatches": 4})
    group = build_model(ModelConfig(name="resnet", options={"norm": "group"}), CIFAR, meta=True)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in group.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in group.modules())
    check_model(group, pipeline, 2)
    batch = build_model(ModelConfig(name="resnet"), CIFAR, meta=True)
    with pytest.raises(ValueError, match=r"BatchNorm's running statistics.*GroupNorm"):
        check_model(batch, pipeline, 2)


def test_initial_weights_are_a_function_of_the_seed_in_memory_and_layer_by_layer_from_meta():
    cfg = ModelConfig(name="resnet", options={"widths": [8, 16], "blocks": [1, 1]})

    def built(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(cfg, SMALL).state_dict()

    first, again, other = built(0), built(0), built(1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["3.body.0.weight"], other["3.body.0.weight"])
    # The pipeline's rule: a layer's weights depend on the seed and its index only, not on which
    # other layers were materialised, so stages built apart start as one process would.
    whole = meta.materialise(build_model(cfg, SMALL, meta=True), "cpu", seed=5)
    block_alone = meta.materialise(build_model(cfg, SMALL, meta=True), "cpu", seed=5, layers=[4])
    assert [i for i, layer in enumerate(block_alone) if meta.is_meta(layer)] == [0, 1, 3, 8]  # the other holders
    for k, v in block_alone[4].state_dict().items():
        torch.testing.assert_close(v, whole[4].state_dict()[k], rtol=0, atol=0)
    assert whole(torch.rand(2, 1, 8, 8)).shape == (2, 4)


def test_initial_weights_are_only_what_each_layer_s_reset_parameters_draws():
    """No initialisation of its own: meta.materialise re-runs only reset_parameters(), so anything
    more would be lost for a model built on the meta device."""
    torch.manual_seed(3)
    built = build_model(ModelConfig(name="resnet", options={"norm": "group"}), SMALL)
    replayed = build_model(ModelConfig(name="resnet", options={"norm": "group"}), SMALL, meta=True).to_empty(
        device="cpu"
    )
    torch.manual_seed(3)
    for module in replayed.modules():  # in the order build() made them, as each one's __init__ reset itself
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for (name, a), b in zip(built.state_dict().items(), replayed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _separable(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Grey 8x8 images, noisy, whose class is which quarter holds a bright square."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = 0.3 * torch.rand(n, 1, 8, 8, generator=g)
    for k in range(4):
        top, left = 4 * (k // 2), 4 * (k % 2)
        x[y == k, :, top : top + 4, left : left + 4] += 0.7
    return x, y


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_it_learns_a_separable_image_set(norm):
    torch.manual_seed(0)
    model = _build(SMALL, widths=[8, 16], blocks=[1, 1], norm=norm)
    x, y = _separable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(4) and losses[-1] < 0.2 * losses[0], losses
    assert (model.eval()(x).argmax(1) == y).float().mean() > 0.9


def test_activation_checkpointing_recomputes_whole_blocks_to_the_same_gradients():
    torch.manual_seed(0)
    plain = _build(SMALL, widths=[8, 16], blocks=[1, 1], norm="group")
    checkpointed = enable_activation_checkpointing(copy.deepcopy(plain), segments=3)
    x, y = _separable(16)
    for model in (plain, checkpointed):
        F.cross_entropy(model(x), y).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
