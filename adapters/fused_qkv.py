"""One matrix product for the q, k and v projections of an attention module.

``FusedQKV`` copies a module's ``q_proj``, ``k_proj`` and ``v_proj`` weights (and biases) into
one ``[3 * width, width]`` tensor once, then makes the three projections' own parameters views
of it: nothing else is copied, ``state_dict`` keys and the module's own forward are unchanged,
and in-place weight updates reach the fused tensor. Re-allocated parameters
(``model.to(...)``, ``load_state_dict(..., assign=True)``) are fused again by :meth:`refresh`,
which plans call before running their region, outside any capture and any compiled code.

``fused_attention_forward`` is a forward for transformers' CLIP-style attention modules
(``CLIPAttention``, ``SiglipAttention``) that takes q, k and v from the fused product and
otherwise does what theirs does, through the attention function the model's config names.
It does not combine with tensor-parallel (DTensor) weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedQKV", "fused_attention_forward", "has_qkv_projections"]


def has_qkv_projections(module: nn.Module) -> bool:
    """Whether ``module`` has separate ``q_proj``, ``k_proj`` and ``v_proj`` linear layers."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in _NAMES)


_NAMES = ("q_proj", "k_proj", "v_proj")


class FusedQKV:
    """The fused q/k/v weight (and bias) of one attention module; see the module docstring."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, module: nn.Module) -> None:
        if not has_qkv_projections(module):
            raise ValueError(
                f"fuse_qkv needs q_proj, k_proj and v_proj linear layers; "
                f"{type(module).__name__} does not have them"
            )
        self._module = module
        self._fuse()

    def _projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self._module, name) for name in _NAMES)  # type: ignore[return-value]

    def _fuse(self) -> None:
        projections = self._projections()
        if any(hasattr(p.weight, "to_local") for p in projections):
            raise ValueError("fuse_qkv does not combine with tensor-parallel (DTensor) weights")
        width = projections[0].out_features
        with torch.no_grad():
            self.weight = torch.cat([p.weight for p in projections])
            has_bias = projections[0].bias is not None
            self.bias = torch.cat([p.bias for p in projections]) if has_bias else None
        for index, projection in enumerate(projections):
            rows = slice(index * width, (index + 1) * width)
            trainable = projection.weight.requires_grad
            projection.weight = nn.Parameter(self.weight[rows], requires_grad=trainable)
            if self.bias is not None:
                projection.bias = nn.Parameter(self.bias[rows], requires_grad=trainable)

    @torch.compiler.disable
    def refresh(self) -> None:
        """Fuse again if the q, k or v weights no longer live in the fused tensor.

        Never traced by ``torch.compile`` (it reads data pointers): a compiled region runs it
        as it is.
        """
        weight = self.weight
        step = weight.stride(0) * self._projections()[0].out_features * weight.element_size()
        expected = [weight.data_ptr() + index * step for index in range(3)]
        if [p.weight.data_ptr() for p in self._projections()] != expected:
            self._fuse()


def fused_attention_forward(module: nn.Module, fused: FusedQKV) -> Callable[..., Any]:
    """A forward for a CLIP-style attention ``module`` computing q, k and v in one product."""
    modeling = sys.modules[type(module).__module__]
    attention_functions = modeling.ALL_ATTENTION_FUNCTIONS
    eager_attention = modeling.eager_attention_forward

    def forward(
        hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        q, k, v = (
            part.view(*input_shape, -1, module.head_dim).transpose(1, 2)
            for part in F.linear(hidden_states, fused.weight, fused.bias).chunk(3, dim=-1)
        )
        attend = attention_functions.get_interface(
            module.config._attn_implementation, eager_attention
        )
        out, weights = attend(
            module,
            q,
            k,
            v,
            attention_mask,
            **{
                "is_causal": module.is_causal,
                "scaling": module.scale,
                "dropout": 0.0 if not module.training else module.dropout,
                **kwargs,
            },
        )
        return module.out_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward
