"""The Idefics2, Idefics3 and SmolVLM towers' plan: position ids a CUDA graph can capture.

transformers 5.6 to 5.2x's embeddings of these towers write each image's position ids with
boolean-mask indexing (``position_ids[mask] = pos_ids[mask]``), whose output size depends on
the mask's values: a CUDA stream capture refuses it ("operation not permitted when stream is
capturing"), so the whole tower could not be captured on a GPU. Later releases compute the
same ids with ``torch.where``; some releases round the fractional coordinates to the pixels'
dtype first. :class:`CapturablePositions` computes the embeddings' inference calls that way,
rounding as the embeddings' own forward is seen to on a probe image, as one fixed-shape
computation, so the graphs still hold the whole tower (patch embedding and position lookup
included) and the ``patch_attention_mask`` stays a graph input: the ids of a padded image are
computed inside the replay from the mask it is given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layergraph_adapters.kit.automatic import SpeedChoices
from layergraph_adapters.kit.hf_vision import VisionTowerPlan, pixels_of
from layergraph_adapters.kit.rewrites import InferenceForward
from layergraph_adapters.kit.tower_specs import TowerSpec, find_module

__all__ = ["CapturablePositions", "IdeficsPlan", "patch_position_ids"]


def patch_position_ids(
    patch_attention_mask: torch.Tensor, per_side: int, coords_dtype: torch.dtype | None
) -> torch.Tensor:
    """The position ids transformers' Idefics embeddings give each patch: each image's real
    patches (``patch_attention_mask``, batch x rows x columns) spread over the ``per_side`` x
    ``per_side`` position table, padding at 0; fractional coordinates rounded to
    ``coords_dtype`` first where the release does so. No host read, no data-dependent shape."""
    batch, rows, columns = patch_attention_mask.shape
    device = patch_attention_mask.device
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)
    steps_h = 1.0 / patch_attention_mask[:, :, 0].sum(dim=1)
    steps_w = 1.0 / patch_attention_mask[:, 0, :].sum(dim=1)
    coords_h = torch.arange(rows, device=device, dtype=torch.float32)[None, :] * steps_h[:, None]
    coords_w = torch.arange(columns, device=device, dtype=torch.float32)[None, :] * steps_w[:, None]
    coords_h = torch.clamp(coords_h, max=1.0 - 1e-6)
    coords_w = torch.clamp(coords_w, max=1.0 - 1e-6)
    if coords_dtype is not None:
        coords_h, coords_w = coords_h.to(coords_dtype), coords_w.to(coords_dtype)
    buckets_h = torch.bucketize(coords_h, boundaries, right=True)
    buckets_w = torch.bucketize(coords_w, boundaries, right=True)
    ids = (buckets_h[:, :, None] * per_side + buckets_w[:, None, :]).reshape(batch, -1)
    return torch.where(patch_attention_mask.reshape(batch, -1), ids, torch.zeros_like(ids))


class CapturablePositions(InferenceForward):
    """Computes an Idefics embeddings module's inference calls with :func:`patch_position_ids`:
    the same values as its own forward, without boolean-mask indexing."""

    def __init__(self, module: nn.Module) -> None:
        for name in ("patch_embedding", "position_embedding", "num_patches_per_side"):
            if not hasattr(module, name):
                raise TypeError(f"{type(module).__name__} has no {name}: not Idefics embeddings")
        super().__init__(module, "position ids computed without boolean-mask indexing")
        self._rounds: dict[torch.dtype, bool] = {}
        """Whether the embeddings' own forward rounds the fractional coordinates to the pixels'
        dtype (transformers 5.6 does; bf16 rounding moves some patches to a neighbouring
        position), by dtype, as :meth:`_rounds_coords` found."""

    def _rounds_coords(self, pixel_values: torch.Tensor) -> bool:
        """Whether the embeddings' own forward rounds coordinates to ``pixel_values``' dtype:
        read once per dtype, on the first call (eager, or a graph's warm-up), by running it on
        a probe image whose coordinates round to other positions, and comparing."""
        dtype = pixel_values.dtype
        if dtype not in self._rounds:
            self._rounds[dtype] = self._probe(pixel_values)
        return self._rounds[dtype]

    def _probe(self, like: torch.Tensor) -> bool:
        module: Any = self.module
        per_side, patch = module.num_patches_per_side, module.patch_embedding.kernel_size[0]
        for rows in range(2, per_side + 1):
            mask = torch.ones(1, rows, 1, dtype=torch.bool, device=like.device)
            rounded = patch_position_ids(mask, per_side, like.dtype)
            if not torch.equal(rounded, patch_position_ids(mask, per_side, None)):
                break
        else:  # no coordinate rounds to another position in this dtype: either way is the same
            return False
        pixels = torch.randn(
            1, like.shape[1], rows * patch, patch, dtype=like.dtype, device=like.device
        )
        own = type(module).forward(module, pixels, patch_attention_mask=mask)
        return torch.equal(own, self._embeddings(pixels, rounded))

    def _embeddings(self, pixel_values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        module: Any = self.module
        embeddings = module.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return embeddings + module.position_embedding(ids)

    def compute(
        self, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor, **_: Any
    ) -> torch.Tensor:
        ids = patch_position_ids(
            patch_attention_mask.bool(),
            self.module.num_patches_per_side,
            pixel_values.dtype if self._rounds_coords(pixel_values) else None,
        )
        return self._embeddings(pixel_values, ids)


class IdeficsPlan(VisionTowerPlan):
    """The shared tower plan, with the embeddings' position ids made capturable and a call
    without ``patch_attention_mask`` given its all-ones mask on the pixels' device.

    The towers' own forward builds a missing mask on the CPU and copies it to the pixels'
    device, a copy a CUDA stream capture refuses; Aria calls its Idefics3 tower that way
    when it is given no ``pixel_mask``.
    """

    def __init__(
        self,
        tower: nn.Module,
        spec: TowerSpec,
        *,
        feature_layers: int | list[int] | None = None,
        choices: SpeedChoices,
    ) -> None:
        super().__init__(tower, spec, feature_layers=feature_layers, choices=choices)
        found = find_module(tower, self.spec.embeddings)
        if found is not None:
            self._rewrites.append(CapturablePositions(found[1]))

    def region(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 and kwargs.get("patch_attention_mask") is None:
            pixels = pixels_of(args, kwargs)
            rows, columns = (side // size for side, size in zip(pixels.shape[-2:], self.patch_size))
            kwargs["patch_attention_mask"] = torch.ones(
                pixels.shape[0], rows, columns, dtype=torch.bool, device=pixels.device
            )
        return super().region(*args, **kwargs)
