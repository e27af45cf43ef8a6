"""A transformer layer's residual add and the next normalisation, in one Triton kernel.

Between a pre-norm layer's attention and its MLP, eager PyTorch runs up to three
memory-bound kernels, each reading and writing the whole hidden state: the layer scale
(``scale * h``), the residual add and the LayerNorm or RMSNorm. :func:`add_norm` computes

    residual_out = residual + scale * h
    normed = norm(residual_out) * weight + bias

in one pass over each row: one read of ``residual`` and ``h``, one write of each output. The
sum is rounded to the inputs' dtype before it is normalised, so ``normed`` is the norm of
``residual_out`` as stored, as in the eager composition; everything else is computed in
float32 and rounded once (eager rounds ``scale * h`` and the sum separately).

One program computes one row of up to :data:`MAX_WIDTH` channels, the whole row in registers.
The launch allocates its outputs and does no host synchronisation, so it can be captured in a
CUDA graph. It is the PyTorch operator ``torch.ops.layergraph.add_norm``, which
``torch.compile`` keeps as one opaque call inside a compiled layer. It runs on CUDA, and on
the CPU under ``TRITON_INTERPRET=1`` (for tests).

:func:`norm` is the normalisation alone, for norms that eager runs as several kernels.
:func:`add_scaled` is the layer's last residual add, ``residual + scale * h``: PyTorch's
``addcmul`` is already one kernel for it, so it is not a Triton kernel.

What it does not do: no backward pass, no normalisation over more than the last dimension, no
dropout, no statistics (mean, reciprocal deviation) returned.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

__all__ = ["MAX_WIDTH", "add_norm", "add_scaled", "norm"]

MAX_WIDTH = 8192
"""The widest row :func:`add_norm` takes: a row lives in one program's registers."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_norm_kernel(
    residual_ptr,
    h_ptr,
    scale_ptr,
    weight_ptr,
    bias_ptr,
    residual_out_ptr,
    normed_ptr,
    width,
    eps,
    ADD: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * width
    columns = tl.arange(0, BLOCK_D)
    inside = columns < width
    residual = tl.load(residual_ptr + start + columns, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        h = tl.load(h_ptr + start + columns, mask=inside, other=0.0).to(tl.float32)
        if HAS_SCALE:
            h = h * tl.load(scale_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        summed = (residual + h).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + start + columns, summed, mask=inside)
        x = summed.to(tl.float32)
    else:
        x = residual
    if RMS:
        variance = tl.sum(x * x, axis=0) / width
        y = x * tl.rsqrt(variance + eps)
    else:
        centred = tl.where(inside, x - tl.sum(x, axis=0) / width, 0.0)
        variance = tl.sum(centred * centred, axis=0) / width
        y = centred * tl.rsqrt(variance + eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    tl.store(normed_ptr + start + columns, y.to(normed_ptr.dtype.element_ty), mask=inside)


def add_norm(
    residual: torch.Tensor,
    h: torch.Tensor,
    scale: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kind: Literal["layer_norm", "rms_norm"],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + scale * h, norm(residual + scale * h) * weight + bias)``, new tensors.

    ``residual`` and ``h`` have one shape and dtype (float16, bfloat16 or float32), the norm
    taken over their last dimension of at most :data:`MAX_WIDTH`; both results have that
    shape and dtype. ``scale``, ``weight`` and ``bias`` are vectors of that width in any
    floating dtype, or ``None`` for none. ``kind`` is ``"layer_norm"`` (mean and variance) or
    ``"rms_norm"`` (mean square, no centring, and ``bias`` must be ``None`` or zero to mean
    what an RMSNorm means). Raises ``ValueError`` for other shapes, dtypes or kinds.
    """
    _check(residual, h, (scale, weight, bias), kind)
    return torch.ops.layergraph.add_norm(
        residual, h, scale, weight, bias, float(eps), kind == "rms_norm"
    )


def norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kind: Literal["layer_norm", "rms_norm"],
) -> torch.Tensor:
    """``norm(x) * weight + bias`` over the last dimension, a new tensor: the normalisation
    :func:`add_norm` computes, without the add, in one kernel.

    For the norms eager PyTorch runs as several kernels (an RMSNorm module written as a float32
    cast, a mean of squares, a reciprocal root and two products); ``nn.LayerNorm`` is one kernel
    already. Takes what :func:`add_norm` takes; raises ``ValueError`` likewise.
    """
    _check(x, x, (weight, bias), kind)
    return torch.ops.layergraph.norm(x, weight, bias, float(eps), kind == "rms_norm")


def add_scaled(residual: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``residual + scale * h`` (``residual + h`` without a scale) as one PyTorch kernel."""
    return residual + h if scale is None else torch.addcmul(residual, h, scale)


def _check(
    residual: torch.Tensor,
    h: torch.Tensor,
    vectors: tuple[torch.Tensor | None, ...],
    kind: str,
) -> None:
    if kind not in ("layer_norm", "rms_norm"):
        raise ValueError(f"kind={kind!r}: choose 'layer_norm' or 'rms_norm'")
    if residual.shape != h.shape or residual.dtype != h.dtype:
        raise ValueError(
            f"residual and h must have one shape and dtype, got {tuple(residual.shape)} "
            f"{residual.dtype} and {tuple(h.shape)} {h.dtype}"
        )
    if residual.dtype not in _DTYPES:
        raise ValueError(f"add_norm takes float16, bfloat16 or float32, got {residual.dtype}")
    width = residual.shape[-1] if residual.dim() else 0
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"the last dimension must hold 1 to {MAX_WIDTH} channels, got {width}")
    for vector in vectors:
        if vector is not None and (
            vector.shape != (width,)
            or not vector.is_floating_point()
            or vector.device != residual.device
        ):
            raise ValueError(
                f"scale, weight and bias must be floating vectors of {width} channels on "
                f"{residual.device}, got {tuple(vector.shape)} {vector.dtype} on {vector.device}"
            )


@torch.library.custom_op("layergraph::add_norm", mutates_args=())
def _add_norm_op(
    residual: torch.Tensor,
    h: torch.Tensor,
    scale: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch as a PyTorch operator, opaque to ``torch.compile``."""
    residual, h = residual.contiguous(), h.contiguous()
    residual_out, normed = torch.empty_like(residual), torch.empty_like(residual)
    if residual.numel() == 0:
        return residual_out, normed
    _launch(residual, h, scale, weight, bias, residual_out, normed, eps, rms)
    return residual_out, normed


@torch.library.custom_op("layergraph::norm", mutates_args=())
def _norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool
) -> torch.Tensor:
    """The norm-only launch as a PyTorch operator, opaque to ``torch.compile``."""
    x = x.contiguous()
    normed = torch.empty_like(x)
    if x.numel():
        _launch(x, None, None, weight, bias, None, normed, eps, rms)
    return normed


def _launch(
    residual: torch.Tensor,
    h: torch.Tensor | None,
    scale: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    normed: torch.Tensor,
    eps: float,
    rms: bool,
) -> None:
    """One program per row of contiguous ``residual``; without ``h``, the norm alone."""
    width = residual.shape[-1]
    block = triton.next_power_of_2(width)
    _add_norm_kernel[(residual.numel() // width,)](
        residual,
        residual if h is None else h,
        _contiguous(scale, residual),
        _contiguous(weight, residual),
        _contiguous(bias, residual),
        normed if residual_out is None else residual_out,
        normed,
        width,
        eps,
        ADD=h is not None,
        HAS_SCALE=scale is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        RMS=rms,
        BLOCK_D=block,
        num_warps=min(max(block // 256, 1), 8),
    )


def _contiguous(vector: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """``vector`` made contiguous, or ``placeholder`` for an absent one (never read)."""
    return placeholder if vector is None else vector.contiguous()


@_add_norm_op.register_fake
def _(
    residual: torch.Tensor,
    h: torch.Tensor,
    scale: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual.contiguous()
    return torch.empty_like(residual), torch.empty_like(residual)


@_norm_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool
) -> torch.Tensor:
    return torch.empty_like(x.contiguous())
