"""A gated MLP's activation, ``silu(gate) * up``, in one Triton kernel.

A gated MLP (Qwen2.5-VL's and the GLM towers' vision MLPs) computes ``down(silu(gate(x)) *
up(x))``. Between the products eager PyTorch runs two memory-bound kernels over the widest
activation of the layer: the SiLU, which writes a copy of the gate, and the product, which
reads it back with ``up``. :func:`silu_and_mul` reads ``gate`` and ``up`` once and writes the
result once, computing in float32 and rounding once (eager rounds the SiLU's result first).

``gate`` and ``up`` may be views with any row stride and unit column stride, as the two halves
of one fused gate-and-up product are. The launch allocates its output and does no host
synchronisation, so it can be captured in a CUDA graph. It is the PyTorch operator
``torch.ops.layergraph.silu_and_mul``, opaque to ``torch.compile``. It runs on CUDA, and on the
CPU under ``TRITON_INTERPRET=1`` (for tests).

What it does not do: no backward pass, no activation other than SiLU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["silu_and_mul"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024
"""Columns one program computes."""


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < width
    gate = tl.load(gate_ptr + row * gate_row_stride + columns, mask=inside, other=0.0)
    up = tl.load(up_ptr + row * up_row_stride + columns, mask=inside, other=0.0)
    gate = gate.to(tl.float32)
    result = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + row * width + columns, result.to(out_ptr.dtype.element_ty), mask=inside)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as a new contiguous tensor of their shape and dtype.

    ``gate`` and ``up`` are ``[rows, width]`` of one dtype (float16, bfloat16 or float32) on one
    device, each with unit stride along its columns. Raises ``ValueError`` otherwise.
    """
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(
            f"gate and up must both be [rows, width], got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype or gate.dtype not in _DTYPES:
        raise ValueError(
            f"gate and up must have one dtype of float16, bfloat16 or float32, got {gate.dtype} "
            f"and {up.dtype}"
        )
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on one device, got {gate.device} and {up.device}")
    return torch.ops.layergraph.silu_and_mul(gate, up)


@torch.library.custom_op("layergraph::silu_and_mul", mutates_args=())
def _silu_and_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The kernel launch as a PyTorch operator, opaque to ``torch.compile``."""
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    if rows == 0 or width == 0:
        return out
    _silu_and_mul_kernel[(rows, triton.cdiv(width, _BLOCK))](
        gate, up, out, gate.stride(0), up.stride(0), width, BLOCK=_BLOCK, num_warps=4
    )
    return out


@_silu_and_mul_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
