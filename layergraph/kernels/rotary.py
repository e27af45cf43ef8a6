"""Rotary position embeddings applied to a layer's queries and keys in one Triton kernel.

A vision tower with rotary positions (Qwen2-VL to Qwen3.5, GLM-4.1V and later) rotates q and
k in every layer as transformers writes it: each cast to float32, ``x * cos + rotate_half(x)
* sin`` with ``rotate_half`` a slice, a negation and a ``cat``, and the result cast back;
around ten memory-bound kernels per layer, each reading and writing a copy of q or k.
:func:`rotate_queries_and_keys` reads q, k, ``cos`` and ``sin`` once and writes the two
results once, computing in float32 and rounding once, as the eager composition does (the
products may be fused into one multiply-add, a difference of float32 rounding).

One program handles one token's heads of q and k. The launch allocates its outputs and does no
host synchronisation, so it can be captured in a CUDA graph. It is the PyTorch operator
``torch.ops.layergraph.rotate_queries_and_keys``, which ``torch.compile`` keeps as one opaque
call. It runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (for tests).

What it does not do: no backward pass, no rotation of part of the head dimension (the rotated
width is the whole head), no interleaved (GPT-J) pairing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotate_queries_and_keys"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    angle_stride,
    heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_H)[:, None]
    column = tl.arange(0, BLOCK_HALF)[None, :]
    inside = (head < heads) & (column < half)
    angle = cos_ptr + token * angle_stride + column
    cos_low = tl.load(angle, mask=column < half, other=0.0).to(tl.float32)
    cos_high = tl.load(angle + half, mask=column < half, other=0.0).to(tl.float32)
    angle = sin_ptr + token * angle_stride + column
    sin_low = tl.load(angle, mask=column < half, other=0.0).to(tl.float32)
    sin_high = tl.load(angle + half, mask=column < half, other=0.0).to(tl.float32)
    out = token * heads * 2 * half + head * 2 * half + column
    source = q_ptr + token * q_token_stride + head * q_head_stride + column
    _rotate_heads(source, q_out_ptr + out, half, inside, cos_low, cos_high, sin_low, sin_high)
    source = k_ptr + token * k_token_stride + head * k_head_stride + column
    _rotate_heads(source, k_out_ptr + out, half, inside, cos_low, cos_high, sin_low, sin_high)


@triton.jit
def _rotate_heads(source, target, half, inside, cos_low, cos_high, sin_low, sin_high):
    """One token's heads of q or k rotated: ``source`` and ``target`` point at the first half
    of each head's row; cos and sin are given for both halves."""
    low = tl.load(source, mask=inside, other=0.0).to(tl.float32)
    high = tl.load(source + half, mask=inside, other=0.0).to(tl.float32)
    element = target.dtype.element_ty
    tl.store(target, (low * cos_low - high * sin_low).to(element), mask=inside)
    tl.store(target + half, (high * cos_high + low * sin_high).to(element), mask=inside)


def rotate_queries_and_keys(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, new contiguous
    tensors of ``q``'s and ``k``'s dtypes, computed in float32 with ``cos`` and ``sin``
    broadcast over the heads.

    ``q`` and ``k`` are ``[tokens, heads, head_dim]`` in float16, bfloat16 or float32, each with
    unit stride along the head dimension (the views a fused q/k/v projection's output gives are
    taken as they are); ``cos`` and ``sin`` are ``[tokens, head_dim]`` in any floating dtype.
    ``head_dim`` is even. Raises ``ValueError`` for other shapes, dtypes or devices.
    """
    _check(q, k, cos, sin)
    return torch.ops.layergraph.rotate_queries_and_keys(q, k, cos, sin)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(
            f"q and k must both be [tokens, heads, head_dim], got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"the head dimension must be even to rotate halves, got {head_dim}")
    if q.dtype not in _DTYPES or k.dtype not in _DTYPES:
        raise ValueError(
            f"rotate_queries_and_keys takes float16, bfloat16 or float32, got {q.dtype} and "
            f"{k.dtype}"
        )
    for name, angles in (("cos", cos), ("sin", sin)):
        if angles.shape != (tokens, head_dim) or not angles.is_floating_point():
            raise ValueError(
                f"{name} must be a floating [tokens, head_dim] = [{tokens}, {head_dim}] tensor, "
                f"got {tuple(angles.shape)} {angles.dtype}"
            )
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
        raise ValueError(
            f"q, k, cos and sin must be on one device, got {sorted(map(str, devices))}"
        )


@torch.library.custom_op("layergraph::rotate_queries_and_keys", mutates_args=())
def _rotate_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch as a PyTorch operator, opaque to ``torch.compile``."""
    tokens, heads, head_dim = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_heads = triton.next_power_of_2(heads)
    _rotate_kernel[(tokens,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        heads,
        half,
        BLOCK_H=block_heads,
        BLOCK_HALF=block_half,
        num_warps=min(max(block_heads * block_half // 256, 1), 8),
    )
    return q_out, k_out


@_rotate_op.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(
        k.shape, dtype=k.dtype, device=k.device
    )
