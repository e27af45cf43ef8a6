"""cuDNN's SDPA over packed sequences, through ``nvidia-cudnn-frontend`` (the ``cudnn`` backend).

PyTorch's varlen kernels pad a head dim such as 72 (Qwen3-VL's, Qwen3.5's, SigLIP2's) to the
next they have, where cuDNN's SDPA, which a tower's own per-image forward gets, does not; and
PyTorch's own entry to cuDNN's ragged path invalidates a CUDA graph capture. The cuDNN
frontend's graph API builds the same kernel once per room, outside any capture, and its
launches capture: :class:`CudnnRaggedAttention` describes q, k, v and the output as
``[slots, heads, longest, head_dim]`` tensors whose sequences start at ragged offsets (element
offsets of each sequence in the packed ``[tokens, heads, head_dim]`` storage), with a padding
mask of each sequence's length. Offsets and lengths are computed from ``cu_seqlens`` inside
the graph, once per forward (:meth:`CudnnRaggedAttention.prepare`), so one graph serves every
packing of its budget.

What it does not do: serve plans that do not call ``prepare`` once per forward (packed plans
offer it only where they do), run off a CUDA device or in float32, or compute the output of
padding tokens (the caller's zeroed workspace keeps them at zero).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from .base import AttentionBackend
from .layout import AttentionMetadata, PackedLayout, SequenceLayout, build_metadata

__all__ = ["CudnnRaggedAttention", "ragged_offsets"]

_DTYPES = (torch.float16, torch.bfloat16)


def ragged_offsets(cu_seqlens: torch.Tensor, token_stride: int, out: torch.Tensor) -> None:
    """Write each sequence's element offset into ``out`` (int64 ``[slots + 1, 1, 1, 1]``): where
    its first token starts in storage whose tokens are ``token_stride`` elements apart."""
    torch.mul(cu_seqlens.view(-1, 1, 1, 1), token_stride, out=out)


class CudnnRaggedAttention(AttentionBackend):
    """cuDNN's SDPA over a packed graph's sequences, ragged in one storage, through the cuDNN
    frontend: one cuDNN graph per room, head dim, dtype and q/k/v strides, built on first use
    (outside a capture: a budget's warm-up or the ``auto`` timing) and kept. GPU only, float16
    and bfloat16, head dims multiples of 8 up to 128, needs ``nvidia-cudnn-frontend``.
    Metadata: ``cu_seqlens``; lengths and offsets in ``scratch``, written by :meth:`prepare`.
    """

    name = "cudnn"
    reads_boundaries = True
    needs_workspace = True
    needs_prepare = True

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], _RaggedGraph] = {}

    @functools.cached_property
    def _frontend(self) -> Any:
        """The ``cudnn`` module of ``nvidia-cudnn-frontend``, or ``None``."""
        if importlib.util.find_spec("cudnn") is None:
            return None
        import cudnn

        return cudnn if hasattr(cudnn, "pygraph") else None

    @property
    def implementation(self) -> str:
        frontend = self._frontend
        return "unavailable" if frontend is None else f"cuDNN frontend {frontend.__version__}"

    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        if device.type != "cuda":
            return "cudnn needs a CUDA device"
        if self._frontend is None:
            return "cudnn needs nvidia-cudnn-frontend (pip install 'layergraph[cudnn]')"
        if dtype not in _DTYPES:
            return f"cudnn needs float16 or bfloat16, not {dtype}"
        if head_dim % 8 or head_dim > 128:
            return f"cudnn takes head dims that are multiples of 8 up to 128, not {head_dim}"
        return None

    def default_metadata(
        self, layout: SequenceLayout | PackedLayout, device: torch.device
    ) -> AttentionMetadata:
        return build_metadata(layout, device, cu_seqlens=True, seq_lens=False)

    def prepare(self, metadata: AttentionMetadata, hidden: torch.Tensor) -> None:
        """Write each sequence's length, and its offsets for every token stride met so far,
        from ``cu_seqlens`` (made on first use; a stride met later is written when met)."""
        cu = metadata.cu_seqlens
        lengths = metadata.scratch.get("cudnn_lengths")
        if lengths is None:
            lengths = torch.empty(cu.numel() - 1, 1, 1, 1, dtype=torch.int32, device=cu.device)
            metadata.scratch["cudnn_lengths"] = lengths
        torch.sub(cu[1:], cu[:-1], out=lengths.view(-1))
        for key, offsets in metadata.scratch.items():
            if key.startswith("cudnn_offsets_"):
                ragged_offsets(cu, int(key.removeprefix("cudnn_offsets_")), offsets)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layout: SequenceLayout,
        metadata: AttentionMetadata,
        workspace: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        if "cudnn_lengths" not in metadata.scratch:
            raise RuntimeError(
                "the cudnn backend reads lengths that prepare() writes: call its prepare once "
                "per forward before the attention layers (packed plans that do say so)"
            )
        q, k, v = (_heads_contiguous(t) for t in (q, k, v))
        out = (
            workspace
            if workspace is not None
            else torch.zeros_like(q, memory_format=torch.contiguous_format)
        )
        strides = tuple(t.stride(0) for t in (q, k, v, out))
        heads, head_dim = q.shape[1], q.shape[2]
        slots = metadata.cu_seqlens.numel() - 1
        key = (q.device, q.dtype, slots, metadata.max_seqlen, heads, head_dim, strides, scale)
        graph = self._graphs.get(key)
        if graph is None:
            graph = _RaggedGraph(self._frontend, key)
            self._graphs[key] = graph
        offsets = [self._offsets(metadata, stride) for stride in strides]
        graph.run(q, k, v, out, offsets, metadata.scratch["cudnn_lengths"])
        return out

    @staticmethod
    def _offsets(metadata: AttentionMetadata, stride: int) -> torch.Tensor:
        """The offsets of ``stride`` in ``metadata.scratch``, written now when first met."""
        name = f"cudnn_offsets_{stride}"
        offsets = metadata.scratch.get(name)
        if offsets is None:
            cu = metadata.cu_seqlens
            offsets = torch.empty(cu.numel(), 1, 1, 1, dtype=torch.int64, device=cu.device)
            ragged_offsets(cu, stride, offsets)
            metadata.scratch[name] = offsets
        return offsets


def _heads_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``[tokens, heads, head_dim]``) with its heads and channels dense, as the
    ragged layout needs (tokens may be further apart); copied only where they are not."""
    heads, head_dim = tensor.shape[1], tensor.shape[2]
    if tensor.stride(2) == 1 and (heads == 1 or tensor.stride(1) == head_dim):
        return tensor
    return tensor.contiguous()


class _RaggedGraph:
    """One built cuDNN SDPA graph over ragged q, k, v and output, and its workspace."""

    def __init__(self, cudnn: Any, key: tuple[Any, ...]) -> None:
        device, dtype, slots, longest, heads, head_dim, strides, scale = key
        self.cudnn = cudnn
        with torch.cuda.device(device):
            self.handle = cudnn.create_handle()
        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        graph = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=self.handle,
        )
        dims = [slots, heads, longest, head_dim]

        def ragged(name: str, stride: int) -> tuple[Any, Any]:
            tensor = graph.tensor(
                name=name,
                dim=dims,
                stride=[longest * stride, head_dim, stride, 1],
                data_type=io,
            )
            offsets = graph.tensor(
                name=f"{name}_offsets",
                dim=[slots + 1, 1, 1, 1],
                stride=[1, 1, 1, 1],
                data_type=cudnn.data_type.INT64,
            )
            tensor.set_ragged_offset(offsets)
            return tensor, offsets

        (self.q, q_offsets), (self.k, k_offsets), (self.v, v_offsets) = (
            ragged(name, stride) for name, stride in zip("qkv", strides[:3])
        )
        self.lengths = graph.tensor(
            name="lengths",
            dim=[slots, 1, 1, 1],
            stride=[1, 1, 1, 1],
            data_type=cudnn.data_type.INT32,
        )
        self.o, _ = graph.sdpa(
            name="sdpa",
            q=self.q,
            k=self.k,
            v=self.v,
            generate_stats=False,
            attn_scale=scale,
            use_padding_mask=True,
            seq_len_q=self.lengths,
            seq_len_kv=self.lengths,
        )
        o_offsets = graph.tensor(
            name="o_offsets",
            dim=[slots + 1, 1, 1, 1],
            stride=[1, 1, 1, 1],
            data_type=cudnn.data_type.INT64,
        )
        self.o.set_output(True).set_dim(dims).set_stride(
            [longest * strides[3], head_dim, strides[3], 1]
        )
        self.o.set_ragged_offset(o_offsets)
        self.offsets = (q_offsets, k_offsets, v_offsets, o_offsets)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        offsets: list[torch.Tensor],
        lengths: torch.Tensor,
    ) -> None:
        """Launch on the current stream (a capture's, inside one)."""
        self.cudnn.set_stream(
            handle=self.handle, stream=torch.cuda.current_stream(q.device).cuda_stream
        )
        pack = {self.q: q, self.k: k, self.v: v, self.o: out, self.lengths: lengths}
        pack.update(zip(self.offsets, offsets))
        self.graph.execute(pack, self.workspace, handle=self.handle)
