"""fuse_norm in the qwen2_vl adapter, on the CPU through Triton's interpreter: each packed
tower's blocks (Qwen2-VL's, Qwen3-VL's, Qwen3-VL-MoE's and Qwen3.5's LayerNorm, Qwen2.5-VL's
and the GLM towers' RMSNorm)
rewritten through wrap (the RMSNorm towers' first norms through the kernel's norm-only path
too), against the unmodified tower, and undone by unwrap().

In float32, answers (simulated graphs) are held to the qwen2_vl tests' 1e-4 relative error
against the tower's own output computed before wrapping. In bfloat16 (attention blunted back
to the init scale, see :func:`blunted`) the graphs with and without fused norms are compared
with the float32 tower: with them, the error must be at most bf16's 2e-2 or 1.25x the error
without, whichever is larger. Inputs are fresh random ones, several images and a video.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import layergraph
from layergraph.kernels import add_norm as kernel
from layergraph.testing import SimulatedGraphs
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.kit.fused_norm import fused_norm_unavailable

pytest.importorskip("transformers")
from test_qwen2_vl_streams import SMALL_GRIDS, TOLERANCE, call, entries, model

pytestmark = pytest.mark.skipif(
    fused_norm_unavailable(torch.device("cpu")) is not None,
    reason="runs the kernel on CPU tensors, through Triton's interpreter",
)
KINDS = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "glm4v",
    "glm_ocr",
    "glm5_next",
]
GRIDS = SMALL_GRIDS
"""Several images, and a video beside an image, in few tokens: Triton's interpreter runs one
program per row."""


def blunted(tower: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``tower`` with its attention's q, k and v weights scaled to the init scale
    (std 0.05): the sharpened attention that makes wrong positions show in float32 turns
    bf16's rounding into differences of 1e-1 that depend on the draw."""
    tower = copy.deepcopy(tower)
    with torch.no_grad():
        for block in tower.blocks:
            block.attn.qkv.weight.mul_(0.05)
    return tower


CASES = [(kind, torch.float32) for kind in KINDS] + [
    (kind, torch.bfloat16) for kind in ("qwen2_vl", "qwen2_5_vl")
]
"""Every tower kind in float32, and in bfloat16 one tower of each norm (LayerNorm, RMSNorm):
the kernel's bfloat16 rounding is the norm's, not the tower's."""


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_packed_blocks_with_fused_norms_equal_the_tower(
    kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    launch = kernel.add_norm

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args[-1])
        return launch(*args)

    monkeypatch.setattr(kernel, "add_norm", counted)
    first_norms: list[str] = []
    norm_alone = kernel.norm

    def counted_alone(*args: Any) -> torch.Tensor:
        first_norms.append(args[-1])
        return norm_alone(*args)

    monkeypatch.setattr(kernel, "norm", counted_alone)
    reference = model(kind)
    if dtype != torch.float32:
        reference = blunted(reference)
    tower = copy.deepcopy(reference).to(dtype)
    inputs = [call(entries(kind, grids)) for grids in GRIDS]
    with torch.inference_mode():
        exact = [reference(p, grid_thw=g).pooler_output for p, g in inputs]
        expected = [tower(p.to(dtype), grid_thw=g).pooler_output for p, g in inputs]
        unfused = layergraph.wrap(
            tower,
            adapter="qwen2_vl",
            backend=SimulatedGraphs(),
            observe_calls=0,
            fuse_norm=False,
            budget_step=16,
        )
        plain = [unfused(p.to(dtype), grid_thw=g).pooler_output.float() for p, g in inputs]
        unfused.unwrap()
        graphed = layergraph.wrap(
            tower,
            adapter="qwen2_vl",
            backend=SimulatedGraphs(),
            observe_calls=0,
            fuse_norm=True,
            budget_step=16,
        )
        for (pixels, grid), want, eager, without in zip(inputs, exact, expected, plain):
            got = graphed(pixels.to(dtype), grid_thw=grid).pooler_output
            if dtype == torch.float32:
                assert relative_error(got, eager) <= TOLERANCE
            else:
                bound = max(DEFAULT_TOLERANCE[dtype], 1.25 * relative_error(without, want))
                assert relative_error(got.float(), want) <= bound
    depth = len(tower.blocks)
    norm = "rms_norm" if "RMSNorm" in type(tower.blocks[0].norm2).__name__ else "layer_norm"
    # per forward, 2 * depth - 1 fused calls (each block's second norm, and each block's first
    # norm but the first's with the residual add before it) and, where eager splits the norm
    # (transformers' RMSNorm classes), the first block's first norm alone
    assert set(calls) == {norm} and len(calls) % (2 * depth - 1) == 0
    if norm == "rms_norm":
        assert set(first_norms) == {norm}
        assert len(calls) == (2 * depth - 1) * len(first_norms)
    else:
        assert first_norms == []
    assert graphed.stats.replays == 2
    assert sum("fuse_norm" in line for line in graphed.changes) == depth
    graphed.unwrap()
    assert all("forward" not in vars(block) for block in tower.blocks)
