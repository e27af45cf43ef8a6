"""Attention backends: dense SDPA, our Triton varlen kernel, and FA3 / PyTorch varlen.

Every backend takes q, k and v packed as ``[tokens, heads, head_dim]`` (views of the
projections; no copies are made to pack them), the layout, the metadata built for it, an
optional workspace, and the softmax scale, and returns the attention output as
``[tokens, heads, head_dim]``. Backends do not build their own metadata at call time: the
caller builds it once per layout, through the ``attention_metadata`` hook, so that a captured
graph keeps its addresses.

Backends are found through the plugin registry, never through this module: plugins register
instances with the ``register_attention_backends`` hook, layergraph's own plugin registers
these three, and :func:`choose_backend` picks among the backends it is given.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ..timing import captured_ms
from ..warn import warn
from .base import AttentionBackend
from .cudnn_ragged import CudnnRaggedAttention
from .layout import (
    AttentionMetadata,
    PackedLayout,
    SequenceLayout,
    build_metadata,
    padded_offsets,
)

__all__ = [
    "AttentionBackend",
    "AttentionBackendFailed",
    "DenseMaskedAttention",
    "Fa3Attention",
    "PackedTimer",
    "SdpaAttention",
    "SdpaMaskedAttention",
    "TritonVarlenAttention",
    "block_mask",
    "choose_backend",
    "choose_packed_backend",
    "packed_timer",
]


class AttentionBackendFailed(UserWarning):
    """An attention backend raised while ``attention="auto"`` timed it for a packed graph's
    room (a library refusing that shape, say): it was passed over, and the fastest of the
    others serves."""


class SdpaAttention(AttentionBackend):
    """Dense ``scaled_dot_product_attention`` over ``[B, heads, S, head_dim]``; uniform layouts."""

    name = "sdpa"

    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        if not layout.is_uniform:
            return "sdpa needs sequences of one length"
        return None

    def default_metadata(self, layout: SequenceLayout, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(max_seqlen=layout.max_length)

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
        batch, length = layout.count, layout.lengths[0]

        def dense(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, *t.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(dense(q), dense(k), dense(v), scale=scale)
        return out.transpose(1, 2).reshape(q.shape)


class SdpaMaskedAttention(AttentionBackend):
    """``scaled_dot_product_attention`` over all tokens at once, with a block-diagonal mask
    built on the device from ``cu_seqlens`` (no host synchronisation, so it can be captured).

    For correctness off the GPU: the mask is ``[tokens, tokens]``, so memory and work grow with
    the square of all tokens, not of each sequence. Tokens past ``cu_seqlens[-1]`` form one
    more sequence of their own (a packed call's padding), so every row attends to something.
    Metadata: ``cu_seqlens``.
    """

    name = "sdpa_varlen"
    reads_boundaries = True

    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        if device.type == "cuda":
            return "sdpa_varlen builds a [tokens, tokens] mask; on a GPU use triton or fa3"
        return None

    def default_metadata(
        self, layout: SequenceLayout | PackedLayout, device: torch.device
    ) -> AttentionMetadata:
        return build_metadata(layout, device, cu_seqlens=True, seq_lens=False)

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
        tokens = torch.arange(q.shape[0], device=q.device, dtype=metadata.cu_seqlens.dtype)
        sequence = torch.searchsorted(metadata.cu_seqlens[1:], tokens, right=True)
        mask = sequence[:, None] == sequence[None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        return out.transpose(0, 1)


class DenseMaskedAttention(AttentionBackend):
    """``scaled_dot_product_attention`` over a packed graph's whole room at once, under a
    block-diagonal additive mask that :meth:`prepare` writes from ``cu_seqlens`` once per
    forward, inside the graph: the dense kernel a tower's own per-image forward gets (cuDNN's
    on an H200), where the varlen kernels pad a head dim such as 72 or 80 to the next they
    have. Its work grows with the square of the room, so packed plans offer it only up to
    :attr:`largest_room` tokens, and ``auto`` takes it only where timed faster. Tokens past
    ``cu_seqlens[-1]`` (a packed call's padding) attend to each other. GPU only.
    Metadata: ``cu_seqlens``, and the mask in ``scratch["mask"]``.
    """

    name = "sdpa_dense_masked"
    reads_boundaries = True
    largest_room = 4096

    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        if device.type != "cuda":
            return "sdpa_dense_masked runs on a GPU (off it, sdpa_varlen computes the same)"
        return None

    def default_metadata(
        self, layout: SequenceLayout | PackedLayout, device: torch.device
    ) -> AttentionMetadata:
        return build_metadata(layout, device, cu_seqlens=True, seq_lens=False)

    def prepare(self, metadata: AttentionMetadata, hidden: torch.Tensor) -> None:
        """Write the block mask of ``metadata``'s boundaries over ``hidden``'s tokens into
        ``metadata.scratch["mask"]``, made on the first call (a graph's warm-up)."""
        tokens = hidden.shape[0]
        mask = metadata.scratch.get("mask")
        if mask is None or mask.shape[-1] != tokens or mask.dtype != hidden.dtype:
            mask = torch.empty(1, 1, tokens, tokens, dtype=hidden.dtype, device=hidden.device)
            metadata.scratch["mask"] = mask
        place = torch.arange(tokens, dtype=metadata.cu_seqlens.dtype, device=hidden.device)
        block_mask(metadata.cu_seqlens, place, mask.dtype, out=mask)

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
        out = F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)),
            attn_mask=metadata.scratch["mask"],
            scale=scale,
        )
        return out[0].transpose(0, 1)


def block_mask(
    cu_seqlens: torch.Tensor,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The additive ``[1, 1, tokens, tokens]`` mask under which each token attends to its own
    sequence only: 0 within one, ``-inf`` across, written into ``out`` where given (in place)
    else into a new tensor. Tokens past the last boundary (a budget's padding) attend to each
    other, so that every row attends to something. Built on the device from ``cu_seqlens``,
    with no host synchronisation, so a graph can capture it."""
    sequence = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    apart = sequence[:, None] != sequence[None, :]
    if out is None:
        out = torch.empty(1, 1, *apart.shape, dtype=dtype, device=apart.device)
    return out.zero_().masked_fill_(apart, float("-inf"))


class TritonVarlenAttention(AttentionBackend):
    """layergraph's own Triton varlen flash-attention kernel, writing into a workspace.

    Metadata: ``cu_seqlens``, ``seq_lens`` and ``max_seqlen``. Runs on CUDA, or on the CPU
    under ``TRITON_INTERPRET=1`` (slowly; for tests).
    """

    name = "triton"
    needs_workspace = True
    reads_boundaries = True

    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
        if head_dim % 8 or not 16 <= head_dim <= 256:
            return f"head_dim {head_dim} is not a multiple of 8 between 16 and 256"
        return None

    def default_metadata(
        self, layout: SequenceLayout | PackedLayout, device: torch.device
    ) -> AttentionMetadata:
        return build_metadata(layout, device, cu_seqlens=True, seq_lens=True)

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
        from .triton_varlen import varlen_attention

        if workspace is None:
            raise ValueError("the triton backend writes into a workspace; none was given")
        return varlen_attention(
            q, k, v, workspace, metadata.cu_seqlens, metadata.seq_lens, metadata.max_seqlen, scale
        )


class Fa3Attention(AttentionBackend):
    """FA3's ``flash_attn_varlen_func`` when ``flash_attn_interface`` is installed, else
    PyTorch's varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``).

    Metadata: ``cu_seqlens`` and ``max_seqlen``. :attr:`implementation` says which one runs.
    """

    name = "fa3"
    takes_strided_inputs = False
    reads_boundaries = True

    @functools.cached_property
    def _kernel(self) -> tuple[str, Any] | None:
        try:
            from flash_attn_interface import flash_attn_varlen_func
        except ImportError:
            pass
        else:
            return "flash_attn_interface.flash_attn_varlen_func (FA3)", flash_attn_varlen_func
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        return "torch.nn.attention.varlen.varlen_attn", varlen_attn

    @property
    def implementation(self) -> str:
        kernel = self._kernel
        return "unavailable" if kernel is None else kernel[0]

    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        if self._kernel is None:
            return "neither flash_attn_interface nor torch.nn.attention.varlen is installed"
        if device.type != "cuda":
            return "fa3 needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"fa3 needs float16 or bfloat16, not {dtype}"
        return None

    def default_metadata(
        self, layout: SequenceLayout | PackedLayout, device: torch.device
    ) -> AttentionMetadata:
        return build_metadata(layout, device, cu_seqlens=True, seq_lens=False)

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
        name, kernel = self._kernel
        cu, longest = metadata.cu_seqlens, metadata.max_seqlen
        if name.startswith("flash_attn_interface"):
            out = kernel(q, k, v, cu, cu, longest, longest, softmax_scale=scale)
            return out[0] if isinstance(out, tuple) else out
        return kernel(q, k, v, cu, cu, longest, longest, scale=scale)


@functools.lru_cache(maxsize=64)
def choose_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    layout: SequenceLayout,
    *,
    backends: tuple[AttentionBackend, ...],
) -> AttentionBackend:
    """The backend to use: ``name`` itself if it can run here, or for ``"auto"`` the fastest.

    ``backends`` are the candidates, normally every registered one
    (``get_registry().attention_backends()``); this function does not look them up itself.
    ``"auto"`` takes ``sdpa`` off the GPU when it is among them and can run (else the first
    that can); on a GPU it times every backend that can run on random inputs of this layout,
    as it will run: inside a CUDA graph, where launch costs vanish (median of 5 replays of 10
    captured calls), and keeps the fastest, once per (device, dtype, heads, head_dim, layout,
    backends).
    """
    if name != "auto":
        backend = _named(name, backends)
        reason = backend.unavailable_reason(device, dtype, head_dim, layout)
        if reason is not None:
            raise RuntimeError(f"attention backend {name!r} cannot run: {reason}")
        return backend
    reasons = {
        backend: backend.unavailable_reason(device, dtype, head_dim, layout) for backend in backends
    }
    usable = [backend for backend, reason in reasons.items() if reason is None]
    if not usable:
        why = "; ".join(f"{backend.name}: {reason}" for backend, reason in reasons.items())
        raise RuntimeError(f"no attention backend can run here ({why})")
    if device.type != "cuda" or len(usable) == 1:
        return next((backend for backend in usable if backend.name == "sdpa"), usable[0])
    return min(
        usable, key=lambda backend: _time_ms(backend, device, dtype, heads, head_dim, layout)
    )


def _named(name: str, backends: tuple[AttentionBackend, ...]) -> AttentionBackend:
    """The backend of ``backends`` called ``name``; a ``ValueError`` listing the names if none."""
    for backend in backends:
        if backend.name == name:
            return backend
    names = ", ".join([*(backend.name for backend in backends), "auto"])
    raise ValueError(f"unknown attention backend {name!r}; choose one of {names}")


def _time_ms(
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    layout: SequenceLayout,
) -> float:
    q, k, v = torch.randn(3, layout.total, heads, head_dim, device=device, dtype=dtype).unbind(0)
    metadata = backend.default_metadata(layout, device)
    workspace = torch.empty_like(q) if backend.needs_workspace else None

    def run() -> None:
        backend(
            q, k, v, layout=layout, metadata=metadata, workspace=workspace, scale=head_dim**-0.5
        )

    return captured_ms(run, device=device)


_PACKED_TIMING = {"warmup": 1, "calls": 5, "replays": 3}
"""How each backend is timed for a packed graph's budget (:func:`~layergraph.timing.captured_ms`):
one call warms up (compiles), and the median of three replays of five captured calls decides.
Timed once per budget and kind of attention, at every capture of a budget: fewer calls than
:func:`choose_backend` times, whose choice is made once per layout."""

PackedTimer = Callable[[AttentionBackend, PackedLayout, tuple[int, ...]], float]
"""Milliseconds of one attention call of a backend in a packed graph: room of a
:class:`~layergraph.attention.PackedLayout`, sequences of the given lengths in it."""


def packed_backends(
    registered: Iterable[AttentionBackend],
    attention: str,
    dense: bool = False,
    dense_in_auto: bool = True,
) -> tuple[AttentionBackend, ...]:
    """The backends a packed plan may use: the masked SDPA, which reads ``cu_seqlens`` on the
    device; with ``dense`` (the plan calls its backends' :meth:`~AttentionBackend.prepare`
    once per forward) the whole room under one block-diagonal mask on a GPU
    (:class:`DenseMaskedAttention`; with ``dense_in_auto=False`` only where ``attention``
    names it) and cuDNN's ragged SDPA (:class:`~layergraph.attention.cudnn_ragged
    .CudnnRaggedAttention`); then every registered backend that reads boundaries at run time
    (those that need ``prepare`` only with ``dense``). Raises ``ValueError`` when ``attention``
    names none of them and is not ``"auto"``."""
    offered = (
        SdpaMaskedAttention(),
        *((DenseMaskedAttention(), CudnnRaggedAttention()) if dense else ()),
    )
    candidates = (
        *offered,
        *(b for b in registered if b.reads_boundaries and (dense or not b.needs_prepare)),
    )
    names = (*(b.name for b in candidates), "auto")
    if attention not in names:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(names)}")
    if attention == "auto" and not dense_in_auto:
        return tuple(b for b in candidates if not isinstance(b, DenseMaskedAttention))
    return candidates


@functools.lru_cache(maxsize=256)
def choose_packed_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    layout: PackedLayout,
    lengths: tuple[int, ...],
    *,
    backends: tuple[AttentionBackend, ...],
    timer: PackedTimer | None,
) -> AttentionBackend:
    """The backend for one kind of attention of a packed graph: ``name`` itself if it reads
    boundaries and can run here, or for ``"auto"`` the fastest on the layout the graph runs.

    ``layout`` is the graph's room (its metadata's sizes, which fix a kernel's grid) and
    ``lengths`` the sequences of a real call in it (the frames of the call that made the
    budget, or its windows), so that a kernel is timed on what it will serve, not on one
    sequence as long as the budget: per-frame attention over a long packed sequence is cheap
    for a varlen kernel and quadratic in all tokens for a masked one. With ``timer`` (on a GPU,
    :func:`packed_timer`) every candidate that can run is timed and the fastest kept; without,
    the first that can run is taken (``sdpa_varlen`` off the GPU). A plan calls this once per
    kind of attention (full, windowed), so the two may get different backends.

    What it does not do: compare with the model's own eager attention (per-image SDPA). That
    cannot be captured for every packing of a budget; the shape policy compares whole graphs
    with the model's eager calls and drops a graph that loses.
    """
    sequences = SequenceLayout(lengths)
    candidates = [backend for backend in backends if backend.reads_boundaries]
    if name != "auto":
        backend = _named(name, tuple(candidates))
        reason = backend.unavailable_reason(device, dtype, head_dim, sequences)
        if reason is not None:
            raise RuntimeError(f"attention backend {name!r} cannot run: {reason}")
        return backend
    reasons = {
        backend: _room_reason(backend, layout)
        or backend.unavailable_reason(device, dtype, head_dim, sequences)
        for backend in candidates
    }
    usable = [backend for backend, reason in reasons.items() if reason is None]
    if not usable:
        why = "; ".join(f"{backend.name}: {reason}" for backend, reason in reasons.items())
        raise RuntimeError(f"no attention backend that reads boundaries can run here ({why})")
    if timer is None or len(usable) == 1:
        return usable[0]
    timed: dict[AttentionBackend, float] = {}
    for backend in usable:
        try:
            timed[backend] = timer(backend, layout, lengths)
        except Exception as failure:  # whatever a kernel raises, the others still serve
            warn(
                f"attention backend {backend.name!r} failed on a room of {layout.tokens} tokens "
                f"and is passed over: {type(failure).__name__}: {failure}",
                AttentionBackendFailed,
            )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    if not timed:
        raise RuntimeError(f"every attention backend failed on a room of {layout.tokens} tokens")
    return min(timed, key=timed.__getitem__)


def _room_reason(backend: AttentionBackend, layout: PackedLayout) -> str | None:
    """Why ``backend`` cannot serve a graph of ``layout``'s room, or ``None``."""
    if backend.largest_room is not None and layout.tokens > backend.largest_room:
        return f"a room of {layout.tokens} tokens is above its {backend.largest_room}"
    return None


def packed_timer(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    v_in_qkv: bool = False,
) -> PackedTimer | None:
    """Times backends inside a CUDA graph on ``device`` (:func:`choose_packed_backend`), given
    q, k and v laid out as the plan hands them: with ``v_in_qkv``, q and k whole and v a view
    into one ``[tokens, 3, heads, head_dim]`` product (a fused q/k/v projection, q and k
    rotated into tensors of their own), copied whole for a backend that does not take strided
    inputs, as the plan copies it; else all three whole. ``None`` off a GPU, where nothing is
    timed."""
    if device.type != "cuda":
        return None
    return functools.partial(_time_packed_ms, device, dtype, heads, head_dim, v_in_qkv)


def _time_packed_ms(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    v_in_qkv: bool,
    backend: AttentionBackend,
    layout: PackedLayout,
    lengths: tuple[int, ...],
) -> float:
    """One call of ``backend`` on ``layout``'s tokens with ``lengths`` written into its
    metadata, as a packed graph runs it (q, k and v as :func:`packed_timer` says), timed
    inside a CUDA graph."""
    if v_in_qkv:
        qkv = torch.randn(layout.tokens, 3, heads, head_dim, device=device, dtype=dtype)
        q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    else:
        q, k, v = torch.randn(3, layout.tokens, heads, head_dim, device=device, dtype=dtype).unbind(
            0
        )
    metadata = backend.default_metadata(layout, device)
    offsets = padded_offsets(lengths, layout.slots)
    if metadata.cu_seqlens is not None:
        metadata.cu_seqlens.copy_(offsets)
    if metadata.seq_lens is not None:
        metadata.seq_lens.copy_(offsets.diff())
    workspace = torch.empty_like(q) if backend.needs_workspace else None
    sequences = SequenceLayout((layout.tokens,))
    backend.prepare(metadata, q)

    def run() -> None:
        given = v if backend.takes_strided_inputs else v.contiguous()
        backend(
            q,
            k,
            given,
            layout=sequences,
            metadata=metadata,
            workspace=workspace,
            scale=head_dim**-0.5,
        )

    return captured_ms(run, device=device, **_PACKED_TIMING)
