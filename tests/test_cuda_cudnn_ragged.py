"""The ``cudnn`` packed attention backend on the GPU (needs ``nvidia-cudnn-frontend``).

One CUDA graph holds ``prepare`` and the backend's call over a room; between replays the
boundaries of fresh random packings are written into ``cu_seqlens`` in place, as a packed plan
writes them. Each replay's output over the real tokens is held to 2e-2 relative error (bf16's
tolerance) against a float32 per-sequence SDPA of the same inputs, and the padding tokens'
rows stay at the zeroed workspace's zeros. Then a Qwen2.5-VL-shaped tower (four blocks,
windows and full attention) at head dims 80 and 72, graphed with ``attention="cudnn"``, is held
to bf16's tolerance or 1.1x the bf16 eager tower's own error against a float32 copy.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import layergraph
from layergraph.attention import CudnnRaggedAttention, PackedLayout, padded_offsets
from layergraph.validation import relative_error

pytestmark = pytest.mark.cuda
pytest.importorskip("cudnn", reason="the cudnn backend needs nvidia-cudnn-frontend")


def per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]):
    outs, start = [], 0
    for length in lengths:
        part = [t[start : start + length].float().transpose(0, 1)[None] for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*part)[0].transpose(0, 1))
        start += length
    return torch.cat(outs)


@pytest.mark.parametrize("head_dim", [72, 80, 64])
def test_one_graph_serves_every_packing_of_its_room(head_dim: int) -> None:
    tokens, slots, heads = 1024, 8, 4
    backend = CudnnRaggedAttention()
    assert backend.unavailable_reason(torch.device("cuda"), torch.bfloat16, head_dim, None) is None
    metadata = backend.default_metadata(PackedLayout(tokens, slots, tokens), torch.device("cuda"))
    qkv = torch.randn(tokens, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)  # strided, as a fused projection gives them
    workspace = torch.zeros(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    metadata.cu_seqlens.copy_(padded_offsets([tokens], slots))

    def forward() -> torch.Tensor:
        backend.prepare(metadata, q)
        return backend(
            q, k, v, layout=None, metadata=metadata, workspace=workspace, scale=head_dim**-0.5
        )

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    draw = random.Random(head_dim)
    for _ in range(6):
        count = draw.randint(1, slots)
        lengths = [draw.randint(1, tokens // count) for _ in range(count)]
        qkv.copy_(torch.randn_like(qkv))
        workspace.zero_()
        metadata.cu_seqlens.copy_(padded_offsets(lengths, slots))
        graph.replay()
        real = sum(lengths)
        assert relative_error(out[:real].float(), per_sequence(q, k, v, lengths)) <= 2e-2, lengths
        assert torch.count_nonzero(out[real:]) == 0


def qwen25_tower(hidden: int) -> torch.nn.Module:
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=hidden,
        num_heads=16,
        intermediate_size=3420,
        window_size=112,
        fullatt_block_indexes=[3],
        out_hidden_size=2048,
    )
    return Qwen2_5_VisionTransformerPretrainedModel(config).eval()


@pytest.mark.parametrize("hidden", [1280, 1152])
def test_a_tower_attending_through_cudnn_is_as_close_to_float32_as_eager(hidden: int) -> None:
    from test_cuda_aligned_mlp import check_against_float32

    reference = qwen25_tower(hidden).cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", observe_calls=0, attention="cudnn", compile_layers=False
    )
    check_against_float32(graphed, reference, model, 1.1)
    routes = graphed.plan.attention_by_budget.values()
    assert routes and all("full: cudnn" in r and "windows: cudnn" in r for r in routes)
    graphed.unwrap()


def test_the_timer_builds_the_graph_the_plans_call_then_uses() -> None:
    """Timed on the layout a fused q/k/v plan hands it (q and k whole, v a view), the cuDNN
    graph built for the room is the one a call of that layout finds: one build per room."""
    from layergraph.attention import packed_timer

    tokens, slots, heads, head_dim = 1024, 8, 4, 72
    device = torch.device("cuda")
    backend = CudnnRaggedAttention()
    layout = PackedLayout(tokens, slots, tokens)
    timer = packed_timer(device, torch.bfloat16, heads, head_dim, True)
    assert timer(backend, layout, (300, 500, 224)) > 0
    assert len(backend._graphs) == 1
    metadata = backend.default_metadata(layout, device)
    metadata.cu_seqlens.copy_(padded_offsets([300, 500, 224], slots))
    qkv = torch.randn(tokens, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    workspace = torch.zeros(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    backend.prepare(metadata, q)
    out = backend(
        q,
        k,
        v,
        layout=None,
        metadata=metadata,
        workspace=workspace,
        scale=head_dim**-0.5,
    )
    assert len(backend._graphs) == 1
    want = per_sequence(q, k, v, [300, 500, 224])
    assert relative_error(out[:1024].float(), want) <= 2e-2
