"""fuse_rotary and fuse_gate on the GPU: the Qwen2.5-VL-7B-shaped tower of the align_mlp test
(its widths, MLP width 3420, windows; four blocks, one of them full attention) in bf16,
graphed with q and k rotated by one kernel and the gated MLP's activation in one kernel.

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
    [{"fuse_rotary": True}, {"fuse_gate": True}, {"fuse_rotary": True, "fuse_gate": True}],
)
def test_fused_kernels_keep_the_tower_as_close_to_float32_as_eager(options: dict) -> None:
    reference = tower().cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    graphed = layergraph.wrap(model, adapter="qwen2_vl", observe_calls=0, **options)
    changes = "\n".join(graphed.changes)
    assert all(name in changes for name in options), changes
    check_against_float32(graphed, reference, model, 1.1)
    graphed.unwrap()
