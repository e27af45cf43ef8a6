"""The ``cudnn`` packed attention backend on the CPU: where it is offered and refused, and the
per-forward work that lets one graph serve every packing of its budget (lengths and ragged
offsets rewritten from ``cu_seqlens`` by ``prepare``). Its kernel runs in
``tests/test_cuda_cudnn_ragged.py``."""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import pytest
import torch

from layergraph.attention import (
    AttentionBackend,
    CudnnRaggedAttention,
    PackedLayout,
    cudnn_ragged,
    packed_backends,
    padded_offsets,
)


def names(backends: tuple[AttentionBackend, ...]) -> list[str]:
    return [backend.name for backend in backends]


def test_offered_only_to_plans_that_prepare_their_backends() -> None:
    class NeedsPrepare(AttentionBackend):
        name = "toy_prepared"
        reads_boundaries = True
        needs_prepare: ClassVar[bool] = True

        def unavailable_reason(self, *args: object) -> None:
            return None

        def default_metadata(self, *args: object) -> None:  # type: ignore[override]
            return None

        def __call__(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            return None

    registered = (NeedsPrepare(),)
    assert names(packed_backends(registered, "auto", dense=True)) == [
        "sdpa_varlen",
        "sdpa_dense_masked",
        "cudnn",
        "toy_prepared",
    ]
    assert names(packed_backends(registered, "auto")) == ["sdpa_varlen"]
    with pytest.raises(ValueError, match="attention='cudnn': choose one of sdpa_varlen, auto"):
        packed_backends(registered, "cudnn")
    auto = packed_backends((), "auto", dense=True, dense_in_auto=False)
    assert names(auto) == ["sdpa_varlen", "cudnn"]


def test_refusals_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = CudnnRaggedAttention()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert backend.unavailable_reason(cpu, torch.bfloat16, 72, None) == (
        "cudnn needs a CUDA device"
    )
    if backend._frontend is not None:
        assert "float16 or bfloat16" in backend.unavailable_reason(cuda, torch.float32, 72, None)
        assert "multiples of 8 up to 128" in backend.unavailable_reason(
            cuda, torch.bfloat16, 76, None
        )
        assert backend.unavailable_reason(cuda, torch.bfloat16, 72, None) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    missing = CudnnRaggedAttention()
    assert missing.implementation == "unavailable"
    assert "pip install 'layergraph[cudnn]'" in missing.unavailable_reason(
        cuda, torch.bfloat16, 72, None
    )


@pytest.mark.parametrize("strides", [(48,), (48, 144)])
def test_prepare_rewrites_lengths_and_every_offset_met_for_each_packing(
    strides: tuple[int, ...],
) -> None:
    """As a captured forward does: ``prepare`` at its start, then each layer's offsets; the
    next forward's packing rewrites both in place (the same tensors, so a graph's addresses
    hold)."""
    backend = CudnnRaggedAttention()
    metadata = backend.default_metadata(PackedLayout(64, 4, 64), torch.device("cpu"))
    tensors = {}
    for lengths in ([64], [20, 30, 4], [1, 1, 1, 1], [16, 16]):
        metadata.cu_seqlens.copy_(padded_offsets(lengths, 4))
        backend.prepare(metadata, torch.empty(64, 8))
        cu = metadata.cu_seqlens.long()
        assert metadata.scratch["cudnn_lengths"].view(-1).tolist() == cu.diff().tolist()
        for stride in strides:
            offsets = backend._offsets(metadata, stride)
            assert offsets.shape == (5, 1, 1, 1) and offsets.dtype == torch.int64
            assert offsets.view(-1).tolist() == (cu * stride).tolist()
            assert tensors.setdefault(stride, offsets) is offsets
        assert (
            tensors.setdefault("lengths", metadata.scratch["cudnn_lengths"])
            is (metadata.scratch["cudnn_lengths"])
        )


def test_heads_and_channels_made_dense_only_where_they_are_not() -> None:
    packed = torch.randn(10, 3, 4, 8)
    q = packed.unbind(1)[0]  # tokens 96 elements apart, heads and channels dense
    assert cudnn_ragged._heads_contiguous(q) is q
    spread = torch.randn(10, 8, 4).transpose(1, 2)  # heads not dense
    made = cudnn_ragged._heads_contiguous(spread)
    assert made.is_contiguous() and torch.equal(made, spread)


def test_a_call_without_prepare_is_refused_with_the_reason() -> None:
    backend = CudnnRaggedAttention()
    metadata = backend.default_metadata(PackedLayout(8, 2, 8), torch.device("cpu"))
    q = torch.zeros(8, 2, 8)
    with pytest.raises(RuntimeError, match="call its prepare once per forward"):
        backend(q, q, q, layout=None, metadata=metadata, workspace=None, scale=1.0)
