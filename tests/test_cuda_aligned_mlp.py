"""align_mlp on the GPU: a Qwen2.5-VL-7B-shaped vision tower (its widths, MLP width 3420,
windows; four blocks, one of them full attention) in bf16, graphed with the MLP padded to 3456.

Marked ``cuda`` and skipped without a GPU. On fresh random inputs, both layergraph's output and
the unwrapped tower's bf16 output are compared with a float32 copy of the tower run eagerly:
layergraph's error must be at most bf16's tolerance (2e-2) or 1.25x eager's own, whichever is
larger (the padded products and the Triton attention round differently from eager, not worse).
The padded products must also be faster than the misaligned ones they replace.
"""

from __future__ import annotations

import copy

import pytest
import torch
from packed_helpers import skip_unless_served

import layergraph
from layergraph.timing import median_ms
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.kit.aligned_mlp import AlignedMLP

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")
skip_unless_served("qwen2_vl")

TOLERANCE = DEFAULT_TOLERANCE[torch.bfloat16]


def tower() -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=1280,
        num_heads=16,
        intermediate_size=3420,
        window_size=112,
        fullatt_block_indexes=[3],
        out_hidden_size=3584,
        spatial_merge_size=2,
        patch_size=14,
        temporal_patch_size=2,
    )
    return Qwen2_5_VisionTransformerPretrainedModel(config).eval()


def check_against_float32(
    graphed: layergraph.GraphedModule,
    reference: torch.nn.Module,
    model: torch.nn.Module,
    factor: float,
) -> None:
    """On fresh images and a video, ``graphed``'s error against the float32 ``reference`` at
    most bf16's tolerance or ``factor`` times the bf16 ``model``'s own, whichever is larger."""
    for grids in ([[1, 32, 32]], [[1, 16, 24], [2, 8, 8]]):
        grid = torch.tensor(grids, device="cuda")
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda")
        with torch.inference_mode():
            want = reference(pixels, grid_thw=grid).pooler_output
            got = graphed(pixels.bfloat16(), grid_thw=grid).pooler_output
            with graphed.original():
                eager = model(pixels.bfloat16(), grid_thw=grid).pooler_output
        eager_error = relative_error(eager, want)
        assert relative_error(got, want) <= max(TOLERANCE, factor * eager_error), grids
    assert graphed.stats.replays == 2


def test_qwen25_tower_with_padded_mlps_is_as_close_to_float32_as_eager() -> None:
    reference = tower().cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    graphed = layergraph.wrap(model, adapter="qwen2_vl", observe_calls=0, compile_layers=False)
    assert graphed.speed_options["align_mlp"] == "on"
    check_against_float32(graphed, reference, model, 1.25)


def test_padded_products_are_faster_than_the_misaligned_ones() -> None:
    mlp = tower().blocks[0].mlp.cuda().to(torch.bfloat16)
    x = torch.randn(4096, 1280, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        misaligned = median_ms(lambda: mlp(x), device=x.device, iters=50)
        want = mlp(x)
        alignment = AlignedMLP(mlp)
        alignment.apply()
        padded = median_ms(lambda: alignment.forward(x), device=x.device, iters=50)
        assert relative_error(alignment.forward(x), want) <= TOLERANCE
        alignment.undo()
    assert padded < misaligned, (padded, misaligned)
