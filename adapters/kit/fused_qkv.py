"""One matrix product for the q, k and v projections of an attention module.

:class:`FusedQKV` is a change made through the wrapper's ledger. Applied, it copies a
module's ``q_proj``, ``k_proj`` and ``v_proj`` weights (and biases) into one
``[3 * width, width]`` tensor and makes the three projections' parameters views of it: the
``Parameter`` objects stay the same (an optimizer holding them still holds them), nothing else
is copied, ``state_dict`` keys and the module's own forward are unchanged, and in-place weight
updates reach the fused tensor. Undone, each parameter gets its own storage back, holding the
values it holds then. Re-allocated parameters (``model.to(...)``,
``load_state_dict(..., assign=True)``) are fused again by :meth:`FusedQKV.refresh`, which plans
call before running their region, outside any capture and any compiled code.

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

from layergraph.ledger import Change
from layergraph_adapters.kit.rewrites import give_back_storage

__all__ = ["FusedQKV", "fused_attention_forward", "has_qkv_projections"]


def has_qkv_projections(module: nn.Module) -> bool:
    """Whether ``module`` has separate ``q_proj``, ``k_proj`` and ``v_proj`` linear layers."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in _NAMES)


_NAMES = ("q_proj", "k_proj", "v_proj")


class FusedQKV(Change):
    """The fused q/k/v weight (and bias) of one attention module; see the module docstring.

    :attr:`weight` and :attr:`bias` exist from the first :meth:`apply` on, and are kept across
    an undo, so that applying again (after ``GraphedModule.original()``) reuses them and the
    projections' parameters get back the addresses the graphs read.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, module: nn.Module) -> None:
        if not has_qkv_projections(module):
            raise ValueError(
                f"fuse_qkv needs q_proj, k_proj and v_proj linear layers; "
                f"{type(module).__name__} does not have them"
            )
        if any(hasattr(p.weight, "to_local") for p in _projections(module)):
            raise ValueError("fuse_qkv does not combine with tensor-parallel (DTensor) weights")
        self.target = module
        self.what = "q, k and v weights made views of one fused weight (fuse_qkv)"
        self._own: list[torch.Tensor] = []
        """The parameters' own data from before :meth:`apply`, weights then biases."""

    def _parameters(self) -> list[nn.Parameter]:
        projections = _projections(self.target)
        return [p.weight for p in projections] + [p.bias for p in projections if p.bias is not None]

    def apply(self) -> None:
        self._own = [p.data for p in self._parameters()]
        self._fuse()

    @torch.no_grad()
    @torch.inference_mode(False)  # shared tensors stay normal ones, written in any mode
    def _fuse(self) -> None:
        projections = _projections(self.target)
        weights = [p.weight.data for p in projections]
        biases = [p.bias.data for p in projections if p.bias is not None]
        if not _fits(getattr(self, "weight", None), weights):
            self.weight = torch.empty(
                (sum(w.shape[0] for w in weights), *weights[0].shape[1:]),
                dtype=weights[0].dtype,
                device=weights[0].device,
            )
            self.bias = None
        if biases and not _fits(self.bias, biases):
            self.bias = torch.empty(
                sum(b.shape[0] for b in biases), dtype=biases[0].dtype, device=biases[0].device
            )
        width = projections[0].out_features
        for index, projection in enumerate(projections):
            rows = slice(index * width, (index + 1) * width)
            self.weight[rows].copy_(projection.weight.data)
            projection.weight.data = self.weight[rows]
            if projection.bias is not None:
                self.bias[rows].copy_(projection.bias.data)
                projection.bias.data = self.bias[rows]

    def undo(self) -> None:
        give_back_storage(self._parameters(), self._own)
        self._own = []

    @torch.compiler.disable
    def refresh(self) -> None:
        """Fuse again if the q, k or v weights no longer live in the fused tensor.

        Never traced by ``torch.compile`` (it reads data pointers): a compiled region runs it
        as it is.
        """
        weight = self.weight
        projections = _projections(self.target)
        step = weight.stride(0) * projections[0].out_features * weight.element_size()
        expected = [weight.data_ptr() + index * step for index in range(3)]
        if [p.weight.data_ptr() for p in projections] != expected:
            self._fuse()


def _projections(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    return tuple(getattr(module, name) for name in _NAMES)  # type: ignore[return-value]


def _fits(fused: torch.Tensor | None, parts: list[torch.Tensor]) -> bool:
    """Whether ``fused`` can hold ``parts`` stacked: the same total rows, dtype and device."""
    return (
        fused is not None
        and fused.shape[0] == sum(p.shape[0] for p in parts)
        and fused.shape[1:] == parts[0].shape[1:]
        and fused.dtype == parts[0].dtype
        and fused.device == parts[0].device
    )


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
