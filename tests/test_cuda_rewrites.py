"""patch_matmul and fuse_gelu on the GPU: the kernels they use, and three towers graphed.

Marked ``cuda`` and skipped without a GPU. Tolerances: in float32 (TF32 off) the rewrites
compute what they replace up to summation order, 1e-5 relative; in bf16 a single product is
within bf16's :data:`~layergraph.validation.DEFAULT_TOLERANCE` (2e-2). Whole towers in bf16 are
compared with the unmodified model, computed before wrapping; their tanh GELU stands in for the
exact one where the model's is exact, so they are held to 5e-2 as InternViT's other attention
kernels are (tests/test_cuda_internvl.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import layergraph
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.kit.patch_embedding import patch_product

pytestmark = pytest.mark.cuda

TOWER_TOLERANCE = 5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_epilogue_is_the_tanh_gelu(float32_without_tf32: None, dtype: torch.dtype) -> None:
    """cuBLASLt's epilogue, through torch._addmm_activation, computes the tanh GELU."""
    rows = torch.randn(300, 256, device="cuda", dtype=dtype)
    weight = torch.randn(1024, 256, device="cuda", dtype=dtype) / 16
    bias = torch.randn(1024, device="cuda", dtype=dtype)
    fused = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    wanted = F.gelu(F.linear(rows.double(), weight.double(), bias.double()), approximate="tanh")
    exact = F.gelu(F.linear(rows.double(), weight.double(), bias.double()))
    tolerance = 1e-5 if dtype == torch.float32 else DEFAULT_TOLERANCE[dtype]
    assert relative_error(fused, wanted) <= tolerance
    if dtype == torch.float32:
        assert relative_error(fused, exact) > 10 * relative_error(fused, wanted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_product_equals_cudnn(float32_without_tf32: None, dtype: torch.dtype) -> None:
    pixels = torch.randn(4, 3, 384, 384, device="cuda", dtype=dtype)  # 27 patches and 6 pixels
    weight = torch.randn(1152, 3, 14, 14, device="cuda", dtype=dtype) / 24
    bias = torch.randn(1152, device="cuda", dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else DEFAULT_TOLERANCE[dtype]
    expected = F.conv2d(pixels, weight, bias, stride=14)
    assert relative_error(patch_product(pixels, weight, bias), expected) <= tolerance


def _vit_base() -> torch.nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_base_patch16_224", pretrained=False)


def _siglip() -> torch.nn.Module:
    pytest.importorskip("transformers")
    from layergraph_adapters.example_models.towers import tower_example

    return tower_example("siglip-so400m-384").build(torch.bfloat16, "cuda")


def _internvit() -> torch.nn.Module:
    pytest.importorskip("transformers")
    from layergraph_adapters.internvl import build_internvit

    return build_internvit("internvit-300m", torch.bfloat16, "cuda")


TOWERS: dict[str, tuple[Callable[[], torch.nn.Module], str, dict[str, Any], int]] = {
    "vit_base, compiled region": (
        _vit_base,
        "timm",
        {"fuse_gelu": "approximate", "compile_region": True},
        224,
    ),
    "siglip so400m, fused qkv": (_siglip, "siglip", {"fuse_gelu": True, "fuse_qkv": True}, 384),
    "internvit-300m, triton": (
        _internvit,
        "internvl",
        {"fuse_gelu": "approximate", "attention": "triton"},
        448,
    ),
}


@pytest.mark.parametrize("name", list(TOWERS))
def test_rewritten_towers_graph_equal_the_model(name: str) -> None:
    build, adapter, options, size = TOWERS[name]
    torch.manual_seed(0)
    model = build().to("cuda", torch.bfloat16).eval()
    timm_style = adapter == "timm"
    inputs = [torch.randn(b, 3, size, size, device="cuda", dtype=torch.bfloat16) for b in (1, 3)]

    def first(output: Any) -> torch.Tensor:
        return output if timm_style else output.last_hidden_state

    def call(module: torch.nn.Module, x: torch.Tensor) -> Any:
        return module(x) if timm_style else module(pixel_values=x)

    torch._dynamo.reset()
    with torch.inference_mode():
        expected = [first(call(model, x)) for x in inputs]
        graphed = layergraph.wrap(
            model,
            adapter=adapter,
            batch_sizes=[1, 4],
            patch_matmul=True,
            compile_layers=False,
            **options,
        )
        try:
            for x, want in zip(inputs, expected):
                assert relative_error(first(call(graphed, x)), want) <= TOWER_TOLERANCE
            with graphed.original() as original:
                assert torch.equal(first(call(original, inputs[0])), expected[0])
        finally:
            graphed.unwrap()
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0
