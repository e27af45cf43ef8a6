"""What the speed options that call layergraph's Triton kernels share: where a kernel can run
at all (checked when a plan is made), and whether one call goes through it (checked at each
call; the module's own computation serves the others).

What this does not do: launch anything (:mod:`layergraph.kernels` holds the kernels).
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["KERNEL_DTYPES", "kernel_takes", "triton_unavailable"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes the kernels compute in."""


def triton_unavailable(option: str, device: torch.device) -> str | None:
    """Why the Triton kernel of the speed option ``option`` cannot run for a model on
    ``device``, or ``None`` if it can."""
    if importlib.util.find_spec("triton") is None:
        return f"{option} runs a Triton kernel and triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"{option} runs a Triton kernel, which needs a CUDA device (or TRITON_INTERPRET=1 "
            f"on the CPU); the model is on {device}"
        )
    return None


def kernel_takes(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` goes through a kernel: a dtype of :data:`KERNEL_DTYPES`,
    gradients off (the kernels have no backward), no autocast, and a CUDA device or Triton's
    interpreter."""
    if torch.is_grad_enabled() or any(t.dtype not in KERNEL_DTYPES for t in tensors):
        return False
    device = tensors[0].device.type
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return not torch.is_autocast_enabled(device)
