"""The patch_matmul and fuse_gelu rewrites on the CPU: alone, and through every adapter.

The reference is the unmodified model, or for ``fuse_gelu="approximate"`` the same model with
its GELU replaced by the tanh approximation, which is what the rewrite computes. Float32 on
the CPU: a matrix product summing in another order than the convolution, so 1e-4 relative and
1e-5 absolute (tested with ``torch.testing.assert_close``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph_adapters.kit.gelu_epilogue import GeluEpilogue, gelu_epilogues, gelu_kind, mlp_parts
from layergraph_adapters.kit.patch_embedding import PatchMatmul, patch_matmul_for, patch_product

RTOL, ATOL = 1e-4, 1e-5


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    channels=st.integers(1, 4),
    patch=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    grid=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    remainder=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    bias=st.booleans(),
)
def test_patch_product_equals_the_convolution(
    batch: int,
    channels: int,
    patch: tuple[int, int],
    grid: tuple[int, int],
    remainder: tuple[int, int],
    bias: bool,
) -> None:
    """Any patch and image size, pixels past the last whole patch included (left out)."""
    height = grid[0] * patch[0] + remainder[0] % patch[0]
    width = grid[1] * patch[1] + remainder[1] % patch[1]
    conv = nn.Conv2d(channels, 6, kernel_size=patch, stride=patch, bias=bias)
    pixels = torch.randn(batch, channels, height, width)
    got = patch_product(pixels, conv.weight, conv.bias)
    torch.testing.assert_close(got, conv(pixels), rtol=RTOL, atol=ATOL)
    assert got.flatten(2).transpose(1, 2).is_contiguous()  # a row-major token sequence


def test_patch_matmul_routes_the_convolution_while_applied() -> None:
    conv = nn.Conv2d(3, 8, kernel_size=4, stride=4).eval()
    pixels = torch.randn(2, 3, 16, 16)
    rewrite = PatchMatmul(conv)
    rewrite.apply()
    assert not conv(pixels).is_contiguous()  # channels-last: the product's layout
    with torch.no_grad():
        conv.weight.mul_(2)  # in place: the product reads the same storage
    torch.testing.assert_close(conv(pixels), F.conv2d(pixels, conv.weight, conv.bias, 4))
    conv.train()
    assert conv(pixels).is_contiguous()  # training runs the convolution
    rewrite.undo()
    assert "forward" not in conv.__dict__


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 8, kernel_size=4, stride=2),
        nn.Conv2d(3, 8, kernel_size=4, stride=4, padding=1),
        nn.Conv2d(4, 8, kernel_size=4, stride=4, groups=2),
    ],
)
def test_patch_matmul_refuses_convolutions_that_overlap_pad_or_group(conv: nn.Conv2d) -> None:
    with pytest.raises(ValueError, match="kernel equals its stride"):
        PatchMatmul(conv)


def test_patch_matmul_needs_a_convolution() -> None:
    assert patch_matmul_for(nn.Linear(2, 2), False) == []
    with pytest.raises(ValueError, match="Linear has no Conv2d"):
        patch_matmul_for(nn.Linear(2, 2), True)


def test_gelu_kind_is_read_from_values_whatever_the_class() -> None:
    activations = pytest.importorskip("transformers.activations")
    assert gelu_kind(nn.GELU()) == "exact"
    assert gelu_kind(nn.GELU(approximate="tanh")) == "tanh"
    assert gelu_kind(activations.ACT2FN["gelu"]) == "exact"
    assert gelu_kind(activations.ACT2FN["gelu_pytorch_tanh"]) == "tanh"
    assert gelu_kind(activations.ACT2FN["gelu_new"]) == "tanh"
    assert gelu_kind(activations.ACT2FN["quick_gelu"]) is None
    assert gelu_kind(nn.ReLU()) is None
    assert gelu_kind(nn.Linear(3, 3)) is None  # does not take the probe


class _CountedGelu(nn.Module):
    """A GELU that counts its calls, exact or tanh by its attribute ``approximate``."""

    calls = 0

    def __init__(self, approximate: str, scale: nn.Parameter | None = None) -> None:
        super().__init__()
        self.approximate, self.scale = approximate, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        y = torch.nn.functional.gelu(x, approximate=self.approximate)
        return y if self.scale is None else y * self.scale


def test_gelu_kind_probes_each_kind_of_activation_once() -> None:
    _CountedGelu.calls = 0
    assert [gelu_kind(_CountedGelu("none")) for _ in range(24)] == ["exact"] * 24
    assert gelu_kind(_CountedGelu("tanh")) == "tanh"
    assert _CountedGelu.calls == 2  # one probe per setting of the attribute
    scales = [nn.Parameter(torch.tensor(value)) for value in (1.0, 2.0, 1.0)]
    assert [gelu_kind(_CountedGelu("none", scale)) for scale in scales] == ["exact", None, "exact"]
    assert _CountedGelu.calls == 5  # with a parameter, every module is probed


class _Mlp(nn.Module):
    def __init__(self, activation: nn.Module, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), activation, nn.Linear(32, 8)
        self.drop = nn.Dropout(0.5)
        if extra is not None:
            self.norm = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.drop(self.act(self.fc1(x)))
        if hasattr(self, "norm"):
            hidden = self.norm(hidden)
        return self.fc2(hidden)


def test_mlp_parts_takes_only_plain_mlps() -> None:
    assert mlp_parts(_Mlp(nn.GELU())) is not None
    assert mlp_parts(_Mlp(nn.GELU(), extra=nn.Identity())) is not None
    assert mlp_parts(_Mlp(nn.GELU(), extra=nn.LayerNorm(32))) is None  # would be skipped
    assert mlp_parts(nn.Linear(8, 8)) is None
    no_bias = _Mlp(nn.GELU())
    no_bias.fc1 = nn.Linear(8, 32, bias=False)
    assert mlp_parts(no_bias) is None


def test_gelu_epilogue_computes_the_tanh_gelu_and_detaches() -> None:
    torch.manual_seed(0)
    exact = _Mlp(nn.GELU()).eval()
    tanh = copy.deepcopy(exact)
    tanh.act = nn.GELU(approximate="tanh")
    x = torch.randn(2, 5, 8)
    expected = tanh(x)
    with pytest.raises(ValueError, match="fuse_gelu='approximate'"):
        GeluEpilogue(exact)
    for mlp, approximate in ((exact, True), (tanh, False)):
        rewrite = GeluEpilogue(mlp, approximate=approximate)
        rewrite.apply()
        torch.testing.assert_close(mlp(x), expected, rtol=RTOL, atol=ATOL)
        rewrite.undo()
        assert "forward" not in mlp.__dict__
    assert not torch.allclose(exact(x), expected, rtol=0, atol=1e-7)  # the two GELUs differ


def test_gelu_epilogue_leaves_training_to_the_mlp() -> None:
    mlp = _Mlp(nn.GELU(approximate="tanh"))
    GeluEpilogue(mlp).apply()
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    assert (mlp.train()(x) != mlp.eval()(x)).any()  # dropout ran


def test_gelu_epilogue_refuses_other_activations_and_settings() -> None:
    with pytest.raises(ValueError, match="fuses GELU only; _Mlp's activation is ReLU"):
        GeluEpilogue(_Mlp(nn.ReLU()))
    with pytest.raises(ValueError, match="fc2\\(gelu\\(fc1\\(x\\)\\)\\)"):
        GeluEpilogue(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="fuse_gelu='yes': choose False, True or 'approximate'"):
        gelu_epilogues([_Mlp(nn.GELU())], "yes")
    with pytest.raises(ValueError, match="choose False, True"):
        gelu_epilogues([_Mlp(nn.GELU())], 1)
    assert gelu_epilogues([_Mlp(nn.ReLU())], False) == []
    hooked = _Mlp(nn.GELU(approximate="tanh"))
    hooked.fc1.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="tensor-parallel \\(DTensor\\) weights or hooks on fc1"):
        GeluEpilogue(hooked)


# ---- through the adapters -----------------------------------------------------------------


def _timm(name: str) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, depth=2, embed_dim=64, num_heads=2).eval()


def _transformers(class_name: str, config_name: str, **settings: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        **settings,
    )
    torch.manual_seed(0)
    return getattr(transformers, class_name)(config).eval()


MODELS = {  # name: (build, adapter, options, input shape, whether the GELU is exact)
    "timm vit": (lambda: _timm("vit_tiny_patch16_224"), "timm", {}, (3, 224, 224), True),
    "timm vit, no class token": (
        lambda: _timm("vit_base_patch16_siglip_224"),
        "timm",
        {},
        (3, 224, 224),
        True,
    ),
    "siglip": (
        lambda: _transformers(
            "SiglipVisionModel", "SiglipVisionConfig", image_size=30, patch_size=7
        ),
        "siglip",
        {"fuse_qkv": True},
        (3, 30, 30),
        False,
    ),
    "internvl": (
        lambda: _transformers(
            "InternVLVisionModel", "InternVLVisionConfig", image_size=[32, 32], patch_size=[16, 16]
        ),
        "internvl",
        {"attention": "sdpa"},
        (3, 32, 32),
        True,
    ),
}


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_tanh_gelu(model: nn.Module) -> nn.Module:
    reference = copy.deepcopy(model)
    for module in list(reference.modules()):
        for name, child in list(module.named_children()):
            if not list(child.children()) and gelu_kind(child) == "exact":
                setattr(module, name, nn.GELU(approximate="tanh"))
    return reference


@pytest.mark.parametrize("name", list(MODELS))
def test_adapters_graph_the_rewritten_model(name: str) -> None:
    """Both options through wrap: graphs equal the model (tanh GELU where it was exact),
    eager comparisons see the model as it was, and unwrap() restores it."""
    build, adapter, options, shape, exact = MODELS[name]
    model = build()
    reference = _with_tanh_gelu(model) if exact else model
    fuse_gelu = "approximate" if exact else True
    x = torch.randn(3, *shape)
    with torch.inference_mode():
        expected = _first(reference(x) if adapter == "timm" else reference(pixel_values=x))
        as_it_was = _first(model(x) if adapter == "timm" else model(pixel_values=x))
        graphed = layergraph.wrap(
            model,
            adapter=adapter,
            backend=SimulatedGraphs(),
            batch_sizes=[1, 4],
            patch_matmul=True,
            fuse_gelu=fuse_gelu,
            **options,
        )
        call = (lambda m: m(x)) if adapter == "timm" else (lambda m: m(pixel_values=x))
        torch.testing.assert_close(_first(call(graphed)), expected, rtol=RTOL, atol=ATOL)
        with graphed.original() as original:
            torch.testing.assert_close(_first(call(original)), as_it_was, rtol=0, atol=0)
        assert graphed.stats.replays == 1
        routed = [m for m in model.modules() if "forward" in m.__dict__]
        assert sum(isinstance(m, nn.Conv2d) for m in routed) == 1
        assert sum(hasattr(m, "fc1") for m in routed) == 2  # one MLP per layer
        graphed.unwrap()
        rewritten = [m for m in model.modules() if "forward" in m.__dict__]
        assert rewritten == []


def test_exact_gelu_models_need_the_approximate_setting() -> None:
    model = _timm("vit_tiny_patch16_224")
    with pytest.raises(ValueError, match="exact \\(erf\\) GELU"):
        layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), fuse_gelu=True)
    assert [m for m in model.modules() if "forward" in m.__dict__] == []


def test_clip_quick_gelu_is_refused_by_name() -> None:
    model = _transformers("CLIPVisionModel", "CLIPVisionConfig", image_size=32, patch_size=8)
    with pytest.raises(ValueError, match="QuickGELUActivation"):
        layergraph.wrap(model, adapter="clip", backend=SimulatedGraphs(), fuse_gelu=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = model(pixel_values=x).pooler_output
        graphed = layergraph.wrap(
            model, adapter="clip", backend=SimulatedGraphs(), patch_matmul=True
        )
        got = graphed(pixel_values=x).pooler_output
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
