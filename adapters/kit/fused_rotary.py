"""Rotary positions applied to q and k in one Triton kernel (fuse_rotary).

The rotary vision towers (Qwen2-VL to Qwen3.5, the GLM towers) rotate q and k in every layer
with their module's ``apply_rotary_pos_emb_vision``: around ten memory-bound kernels, with
float32 copies of both. :class:`FusedRotary` stands for that function inside a plan's routed
attention and computes the same rotation with :func:`layergraph.kernels.rotary
.rotate_queries_and_keys`, one kernel reading each input once. Values change by rounding only.

A family's function is taken only if it computes the rotate-half rotation: it is evaluated
once on small random float32 inputs on the CPU against the formula (:func:`rotates_halves`),
whatever its source says. Calls the kernel does not take (angles that do not cover the whole
head, and those :func:`~layergraph_adapters.kit.triton_kernels.kernel_takes` refuses) run the
family's own function.

What this does not do: rewrite anything by itself (a plan calls it where it rotates), or
serve interleaved (GPT-J) rotations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layergraph_adapters.kit.triton_kernels import kernel_takes, triton_unavailable

__all__ = ["FusedRotary", "rotates_halves"]

Rotate = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def rotates_halves(rotate: Rotate) -> bool:
    """Whether ``rotate(q, k, cos, sin)`` computes ``x * cos + rotate_half(x) * sin`` for both,
    with ``cos`` and ``sin`` of ``[tokens, head_dim]`` broadcast over the heads: checked on
    random float32 inputs on the CPU."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, 3, 8, generator=generator) for _ in range(2))
    cos, sin = (torch.randn(5, 8, generator=generator) for _ in range(2))
    try:
        with torch.no_grad():
            got = rotate(q, k, cos, sin)
    except Exception:  # whatever the failure, a function that fails the probe is not taken
        return False
    if not (isinstance(got, tuple) and len(got) == 2):
        return False
    for tensor, result in zip((q, k), got):
        halves = torch.cat((-tensor[..., 4:], tensor[..., :4]), dim=-1)
        want = tensor * cos[:, None] + halves * sin[:, None]
        if not isinstance(result, torch.Tensor) or not torch.allclose(result, want, atol=1e-5):
            return False
    return True


class FusedRotary:
    """The rotation ``own`` computes, through the fused kernel where a call fits it.

    Raises ``ValueError`` when the kernel cannot run on ``device`` (no Triton; not CUDA, and
    not Triton's interpreter) or ``own`` is not the rotate-half rotation (:func:`rotates_halves`).
    """

    def __init__(self, own: Rotate, device: torch.device) -> None:
        reason = triton_unavailable("fuse_rotary", device)
        if reason is not None:
            raise ValueError(reason)
        if not rotates_halves(own):
            raise ValueError(
                f"fuse_rotary computes the rotate-half rotation, and {own.__module__}."
                f"{own.__qualname__} computes another"
            )
        self.own = own

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(q, k, cos):
            return self.own(q, k, cos, sin)
        from layergraph.kernels.rotary import rotate_queries_and_keys

        return rotate_queries_and_keys(q, k, cos, sin)

    @staticmethod
    def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
        if q.dim() != 3 or q.shape != k.shape or cos.shape != (q.shape[0], q.shape[2]):
            return False
        return kernel_takes(q, k)
