"""patch_matmul in the qwen2_vl adapter on the CPU: every packed tower's patch embedding (a
``Conv3d`` whose kernel is one patch, over one row of pixels per patch) computed as one matrix
product, against the unmodified tower (off by default); ``"auto"`` takes it on a GPU (the GPU
check replaced) for every family, and a patch embedding of another form is refused, saying why.

Answers (simulated graphs, float32, several images and a video) are held to 1e-3 relative
error against the tower's own output computed before wrapping: the product sums each patch in
another order than the convolution, and the test towers' sharpened attention (see
``test_qwen2_vl_streams``) carries that first layer's rounding to about 2e-4 at the output. In
float64 the product equals the convolution to float64's rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layergraph_adapters.kit import automatic
from layergraph_adapters.kit.patch_embedding import PackedPatchMatmul

pytest.importorskip("transformers")
from test_qwen2_vl_streams import check_answers, model, option_calls, wrapped_with

KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "glm4v", "glm_ocr"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_patch_product_answers_as_the_tower(kind: str) -> None:
    tower = model(kind)
    inputs, want = option_calls(kind)
    graphed = wrapped_with(kind, patch_matmul=True, fuse_norm=False)
    assert [line for line in graphed.changes if "patch_matmul" in line] == [
        "patch_embed: patch convolution as one matrix product (patch_matmul)"
    ]
    try:
        check_answers(graphed, inputs, want, tolerance=1e-3)
        assert graphed.stats.replays == 2
    finally:
        graphed.unwrap()
    assert "forward" not in vars(tower.patch_embed)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_left_to_auto_every_family_takes_it_on_a_gpu(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = wrapped_with(kind)
    assert default.speed_options["patch_matmul"] == "off"
    default.unwrap()
    on_the_cpu = wrapped_with(kind, patch_matmul="auto")
    assert on_the_cpu.speed_options["patch_matmul"].startswith("off: the model is on cpu")
    on_the_cpu.unwrap()
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)
    graphed = wrapped_with(
        kind, fuse_norm=False, fuse_rotary=False, fuse_gate=False, patch_matmul="auto"
    )
    assert graphed.speed_options["patch_matmul"] == "on"
    graphed.unwrap()


def test_another_patch_embedding_is_refused() -> None:
    embed = model("qwen2_5_vl").patch_embed
    padded = nn.Module()
    for name in ("in_channels", "temporal_patch_size", "patch_size", "embed_dim"):
        setattr(padded, name, getattr(embed, name))
    padded.proj = nn.Conv3d(3, 8, kernel_size=(2, 14, 14), stride=(2, 14, 14), padding=1)
    with pytest.raises(ValueError, match="patch_matmul needs a patch embedding whose Conv3d"):
        PackedPatchMatmul(padded)
    with pytest.raises(ValueError, match="Linear is not one"):
        PackedPatchMatmul(nn.Linear(2, 2))


def test_the_product_equals_the_convolution_in_float64() -> None:
    embed = model("qwen3_vl").patch_embed
    rows = torch.randn(37, embed.proj.weight[0].numel(), dtype=torch.float64)
    own = type(embed).forward(embed.double(), rows)
    got = PackedPatchMatmul(embed).compute(rows)
    embed.float()
    torch.testing.assert_close(got, own)
