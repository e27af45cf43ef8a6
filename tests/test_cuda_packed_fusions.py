"""fuse_rotary, fuse_gate, patch_matmul and positions_matmul on the GPU: the
Qwen2.5-VL-7B-shaped tower of the align_mlp test (its widths, MLP width 3420, windows; four
blocks, one of them full attention) in bf16, graphed with q and k rotated by one kernel, the
gated MLP's activation in one kernel, or the patch embedding as one product; and the small
GLM-4.1V tower of the adapter's tests (attention blunted to the init scale) with its position
table resampled by one product.

Marked ``cuda`` and skipped without a GPU. On fresh random inputs, layergraph's output and the
unwrapped tower's bf16 output are compared with a float32 copy run eagerly: layergraph's error
must be at most bf16's tolerance (2e-2) or 1.1x eager's own, whichever is larger (the kernels
round once where eager rounds after each operation).
"""

from __future__ import annotations

import copy

import pytest
import torch
from packed_helpers import skip_unless_served
from test_cuda_aligned_mlp import check_against_float32, tower

import layergraph

pytestmark = pytest.mark.cuda

skip_unless_served("qwen2_vl")


@pytest.mark.parametrize(
    "options",
    [
        {"fuse_rotary": True},
        {"fuse_gate": True},
        {"fuse_rotary": True, "fuse_gate": True},
        {"patch_matmul": True},
    ],
)
def test_fused_kernels_keep_the_tower_as_close_to_float32_as_eager(options: dict) -> None:
    reference = tower().cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", observe_calls=0, compile_layers=False, **options
    )
    changes = "\n".join(graphed.changes)
    assert all(name in changes for name in options), changes
    check_against_float32(graphed, reference, model, 1.1)
    graphed.unwrap()


def test_glm_positions_resampled_by_a_product_keep_the_tower_as_close_to_float32() -> None:
    from test_qwen2_vl_fused_norm import blunted
    from test_qwen2_vl_streams import call, entries, model

    from layergraph.validation import relative_error

    reference = blunted(model("glm4v")).cuda()
    tower = copy.deepcopy(reference).to(torch.bfloat16)
    graphed = layergraph.wrap(
        tower, adapter="qwen2_vl", observe_calls=0, positions_matmul=True, compile_layers=False
    )
    assert any("positions_matmul" in change for change in graphed.changes)
    for grids in ([(1, 8, 12)], [(1, 4, 4), (1, 16, 8)]):
        pixels, grid = call(entries("glm4v", grids))
        pixels, grid = pixels.cuda(), grid.cuda()
        with torch.inference_mode():
            want = reference(pixels, grid_thw=grid).pooler_output
            got = graphed(pixels.bfloat16(), grid_thw=grid).pooler_output
            with graphed.original():
                eager = tower(pixels.bfloat16(), grid_thw=grid).pooler_output
        bound = max(2e-2, 1.1 * relative_error(eager, want))
        assert relative_error(got, want) <= bound, grids
    assert graphed.stats.replays == 2
    graphed.unwrap()
