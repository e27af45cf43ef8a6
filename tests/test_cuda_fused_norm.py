"""fuse_norm on the GPU: InternViT-300M- and InternViT-6B-shaped towers and timm's vit_base
graphed in bf16 with the fused kernel, against the unmodified model.

Marked ``cuda`` and skipped without a GPU (the kernel itself runs on CUDA in
tests/test_add_norm_kernel.py there). Towers have the real widths, heads, tile size and norms
but fewer layers, random weights, layer scales drawn from [0.5, 1.5] per channel so that they
count. The graphs' output on fresh random inputs is compared with the model's own eager output
computed before wrapping: relative error at most 2e-2, bf16's
:data:`~layergraph.validation.DEFAULT_TOLERANCE` (the kernel rounds once where eager rounds
after each operation; the Triton attention kernel and fused q/k/v differ from eager by
rounding too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import layergraph
from layergraph.kernels import add_norm as kernel
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

pytestmark = pytest.mark.cuda

TOLERANCE = DEFAULT_TOLERANCE[torch.bfloat16]


def _scaled(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("lambda_1", "lambda_2", "gamma")):
                parameter.uniform_(0.5, 1.5)
    return model


def _internvit(name: str, depth: int) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        pytest.importorskip("transformers")
        from layergraph_adapters.internvl import INTERNVIT_CONFIGS
        from layergraph_adapters.kit.tower_specs import build_tower

        settings = {**INTERNVIT_CONFIGS[name], "num_hidden_layers": depth}
        return _scaled(build_tower("InternVLVisionModel", settings, torch.bfloat16, "cuda"))

    return build


def _vit_base(init_values: float | None) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        timm = pytest.importorskip("timm")
        model = timm.create_model("vit_base_patch16_224", init_values=init_values)
        return _scaled(model.to("cuda", torch.bfloat16).eval())

    return build


TOWERS: dict[str, tuple[Callable[[], torch.nn.Module], str, dict[str, Any], int]] = {
    "internvit-300m, 4 layers": (_internvit("internvit-300m", 4), "internvl", {}, 448),
    "internvit-300m, 4 layers, fused qkv, patch matmul, triton attention": (
        _internvit("internvit-300m", 4),
        "internvl",
        {"fuse_qkv": True, "patch_matmul": True, "attention": "triton"},
        448,
    ),
    "internvit-6b, 2 layers (rms_norm)": (_internvit("internvit-6b", 2), "internvl", {}, 448),
    "vit_base": (_vit_base(None), "timm", {}, 224),
    "vit_base, layer scale": (_vit_base(1e-5), "timm", {"patch_matmul": True}, 224),
}


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The norm kind of each call of the fused kernel (captures included) during the test."""
    calls: list[str] = []
    launch = kernel.add_norm

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args[-1])
        return launch(*args)

    monkeypatch.setattr(kernel, "add_norm", counted)
    yield calls


@pytest.mark.parametrize("name", list(TOWERS))
def test_fused_norm_graphs_equal_the_model(name: str, kernel_calls: list[str]) -> None:
    build, adapter, options, size = TOWERS[name]
    torch.manual_seed(0)
    model = build()
    timm_style = adapter == "timm"
    batches = (1, 3, 4)

    def call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x) if timm_style else module(pixel_values=x).last_hidden_state

    torch.manual_seed(1)
    inputs = [torch.randn(b, 3, size, size, device="cuda", dtype=torch.bfloat16) for b in batches]
    with torch.inference_mode():
        expected = [call(model, x) for x in inputs]
        graphed = layergraph.wrap(
            model,
            adapter=adapter,
            batch_sizes=[1, 4],
            fuse_norm=True,
            compile_layers=False,
            **options,
        )
        try:
            errors = [relative_error(call(graphed, x), want) for x, want in zip(inputs, expected)]
            with graphed.original() as original:
                assert torch.equal(call(original, inputs[0]), expected[0])
        finally:
            graphed.unwrap()
    assert max(errors) <= TOLERANCE, errors
    assert graphed.stats.replays == len(batches) and graphed.stats.eager_total == 0
    # Each forward launches the kernel once per layer for its add and second norm, and once
    # per layer but the last for its last add with the next layer's first norm.
    assert kernel_calls and len(kernel_calls) % (2 * len(graphed.plan.layers()) - 1) == 0
    assert [m for m in model.modules() if "forward" in m.__dict__] == []
