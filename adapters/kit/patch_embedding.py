"""A ViT's patch embedding as one matrix product instead of a convolution.

A patch embedding is a ``Conv2d`` whose kernel equals its stride: every output pixel is the
dot product of one patch with each filter, so the whole layer is one matrix product of the
patches (gathered into rows) with the filters (viewed as a matrix). cuDNN runs it as a general
convolution, converting layouts on the way; on an H200 the product took 0.006 instead of
0.102 ms for vit_base at batch 1, and 0.30 instead of 1.94 ms for InternViT-300M at batch 32
(``benchmarks/fusion_candidates.py``).

:class:`PatchMatmul` routes one such convolution while applied. Its output has the
convolution's shape and values (up to rounding: the sums run in another order); it is stored
channels-last, so the usual ``flatten(2).transpose(1, 2)`` that follows gives a row-major token
sequence without a copy. The weight is used through a view, so in-place weight updates reach
it. Training calls run the convolution. :class:`PackedPatchMatmul` does the same for the packed
towers' patch embeddings (Qwen2-VL to Qwen3.5, the GLM towers), whose input is already one row
of pixels per patch, so that their ``Conv3d`` is one product of those rows with its filters,
which cuDNN runs as a general implicit convolution. Each is a change made through the wrapper's
ledger (:class:`~layergraph_adapters.kit.rewrites.InferenceForward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layergraph_adapters.kit.rewrites import InferenceForward

__all__ = [
    "PackedPatchMatmul",
    "PatchMatmul",
    "is_patch_convolution",
    "packed_patch_matmul_for",
    "patch_matmul_for",
]


def is_patch_convolution(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Conv2d`` that cuts its input into patches (kernel = stride)."""
    return (
        isinstance(module, nn.Conv2d)
        and module.kernel_size == module.stride
        and module.padding in ((0, 0), "valid")
        and module.dilation == (1, 1)
        and module.groups == 1
    )


def patch_matmul_for(embeddings: nn.Module | None, setting: bool) -> list[PatchMatmul]:
    """The :class:`PatchMatmul` for an adapter's ``patch_matmul`` option, or none without it.

    ``embeddings`` is the module holding the patch convolution (the first ``Conv2d`` inside
    it, or itself). Raises ``ValueError`` when there is none or it is not a patch embedding.
    """
    if not setting:
        return []
    convolutions = [m for m in (embeddings.modules() if embeddings else ()) if type(m) is nn.Conv2d]
    if not convolutions:
        raise ValueError(
            f"patch_matmul needs the model's patch embedding convolution; "
            f"{type(embeddings).__name__} has no Conv2d"
        )
    return [PatchMatmul(convolutions[0])]


class PatchMatmul(InferenceForward):
    """Runs the patch convolution ``conv`` as one matrix product while applied.

    Raises ``ValueError`` for a convolution that is not a patch embedding (see
    :func:`is_patch_convolution`).
    """

    def __init__(self, conv: nn.Module) -> None:
        if not is_patch_convolution(conv):
            raise ValueError(
                f"patch_matmul needs a Conv2d whose kernel equals its stride, with no padding, "
                f"dilation or groups; got {conv!r}"
            )
        super().__init__(conv, "patch convolution as one matrix product (patch_matmul)")

    def compute(self, pixels: torch.Tensor) -> torch.Tensor:
        return patch_product(pixels, self.module.weight, self.module.bias)


def patch_product(
    pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``conv2d(pixels, weight, bias, stride=kernel size)`` as one matrix product.

    ``pixels`` is ``[batch, channels, height, width]``; rows and columns past the last whole
    patch are left out, as the convolution leaves them. Returns ``[batch, filters, rows of
    patches, columns of patches]``, stored channels-last.
    """
    batch, channels, height, width = pixels.shape
    filters, _, patch_h, patch_w = weight.shape
    rows, columns = height // patch_h, width // patch_w
    whole = pixels[:, :, : rows * patch_h, : columns * patch_w]
    patches = whole.reshape(batch, channels, rows, patch_h, columns, patch_w)
    patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch * rows * columns, -1)
    out = F.linear(patches, weight.reshape(filters, -1), bias)
    return out.view(batch, rows, columns, filters).permute(0, 3, 1, 2)


_PACKED_PATCH_ATTRIBUTES = ("proj", "in_channels", "temporal_patch_size", "patch_size", "embed_dim")
"""What a packed tower's patch embedding holds: its ``Conv3d`` and the sizes its forward views
the rows of pixels with."""


def packed_patch_matmul_for(patch_embed: nn.Module, setting: bool) -> list[PackedPatchMatmul]:
    """The :class:`PackedPatchMatmul` for a packed adapter's ``patch_matmul`` option, or none
    without it. Raises ``ValueError`` where ``patch_embed`` is not such a patch embedding."""
    return [PackedPatchMatmul(patch_embed)] if setting else []


class PackedPatchMatmul(InferenceForward):
    """Runs a packed tower's patch embedding (``[patches, channels x frames x height x width]``
    rows of pixels through a ``Conv3d`` whose kernel is one patch) as one matrix product with
    the filters viewed as a matrix, in the filters' dtype, while applied.

    Raises ``ValueError`` for a module without the attributes of one
    (:data:`_PACKED_PATCH_ATTRIBUTES`) or whose convolution is not one patch per output.
    """

    def __init__(self, patch_embed: nn.Module) -> None:
        conv = getattr(patch_embed, "proj", None)
        if not all(hasattr(patch_embed, name) for name in _PACKED_PATCH_ATTRIBUTES) or not (
            isinstance(conv, nn.Conv3d)
            and conv.kernel_size == conv.stride
            and conv.padding in ((0, 0, 0), "valid")
            and conv.dilation == (1, 1, 1)
            and conv.groups == 1
            and conv.kernel_size
            == (patch_embed.temporal_patch_size, patch_embed.patch_size, patch_embed.patch_size)
        ):
            raise ValueError(
                f"patch_matmul needs a patch embedding whose Conv3d kernel is one patch "
                f"(stride = kernel, no padding, dilation or groups); "
                f"{type(patch_embed).__name__} is not one"
            )
        super().__init__(patch_embed, "patch convolution as one matrix product (patch_matmul)")

    def compute(self, hidden_states: torch.Tensor) -> torch.Tensor:
        conv = self.module.proj
        rows = hidden_states.reshape(-1, conv.weight[0].numel()).to(conv.weight.dtype)
        return F.linear(rows, conv.weight.reshape(conv.out_channels, -1), conv.bias)
