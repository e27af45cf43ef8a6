"""InternViT split across the GPUs of a host with PyTorch tensor parallelism.

:func:`parallelize_internvit` splits every layer's heads and MLP units across the ranks of a
one-dimensional device mesh, with ``torch.distributed.tensor.parallel.parallelize_module``:
q, k, v and the MLP's first projection by columns, the attention output and the MLP's second
projection by rows (summed across ranks). What the plain plan cannot do is handled here:

- a head count that does not divide among the ranks (InternViT-6B's 25 heads on 2 GPUs) is
  padded with heads whose weights are zero: their q, k and v are zero, so their output is
  zero, and the output projection's columns for them are zero too;
- a q/k norm over the full width (InternViT-6B's qk-norm) becomes :class:`ShardedRMSNorm`,
  which sums the squares across ranks (one all-reduce) before normalising each rank's share.

Each rank then wraps its tower with ``adapter="internvl"``; the graphs capture the collectives,
and every rank must replay the same keys in the same order (the same inputs on every rank).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ShardedRMSNorm", "parallelize_internvit"]


class ShardedRMSNorm(nn.Module):
    """RMS norm over a width split across ranks: each rank holds ``width / ranks`` features.

    Computes what ``InternVLVisionRMSNorm`` computes on the whole width (padding features, which
    are zero, count neither in the sum nor in ``full_width``).
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, full_width: int, group: dist.ProcessGroup
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = eps
        self.full_width = full_width
        self.group = group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        squares = hidden.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        hidden = hidden * torch.rsqrt(squares / self.full_width + self.eps)
        return self.weight * hidden.to(dtype)


def parallelize_internvit(tower: nn.Module, mesh: object) -> None:
    """Split ``tower`` (an ``InternVLVisionModel``) across ``mesh``'s ranks, in place.

    Every rank must build the same tower (same weights) before calling this.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ranks = mesh.size()
    rank = mesh.get_local_rank()
    group = mesh.get_group()
    config = tower.config
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    padded_heads = math.ceil(heads / ranks) * ranks
    plan = {}
    for index, layer in enumerate(tower.encoder.layer):
        attention = layer.attention
        if padded_heads != heads:
            _pad_heads(attention, (padded_heads - heads) * head_dim)
        if config.use_qk_norm:
            share = padded_heads * head_dim // ranks
            rows = slice(rank * share, (rank + 1) * share)
            for name in ("q_norm", "k_norm"):
                norm = getattr(attention, name)
                setattr(
                    attention,
                    name,
                    ShardedRMSNorm(
                        norm.weight[rows], norm.variance_epsilon, config.hidden_size, group
                    ),
                )
        prefix = f"encoder.layer.{index}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.attention.{name}"] = ColwiseParallel()
        plan[f"{prefix}.attention.projection_layer"] = RowwiseParallel()
        plan[f"{prefix}.mlp.fc1"] = ColwiseParallel()
        plan[f"{prefix}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(tower, mesh, plan)


def _pad_heads(attention: nn.Module, extra: int) -> None:
    """Append ``extra`` zero output features to q, k, v (and norms), zero inputs to the output."""
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            projection = getattr(attention, name)
            padded = nn.Linear(
                projection.in_features,
                projection.out_features + extra,
                bias=projection.bias is not None,
                device=projection.weight.device,
                dtype=projection.weight.dtype,
            )
            padded.weight.zero_()
            padded.weight[: projection.out_features] = projection.weight
            if projection.bias is not None:
                padded.bias.zero_()
                padded.bias[: projection.out_features] = projection.bias
            setattr(attention, name, padded)
        output = attention.projection_layer
        padded = nn.Linear(
            output.in_features + extra,
            output.out_features,
            bias=output.bias is not None,
            device=output.weight.device,
            dtype=output.weight.dtype,
        )
        padded.weight.zero_()
        padded.weight[:, : output.in_features] = output.weight
        if output.bias is not None:
            padded.bias.copy_(output.bias)
        attention.projection_layer = padded
        for name in ("q_norm", "k_norm"):
            norm = getattr(attention, name)
            if isinstance(getattr(norm, "weight", None), nn.Parameter):
                weight = torch.zeros(
                    norm.weight.numel() + extra, dtype=norm.weight.dtype, device=norm.weight.device
                )
                weight[: norm.weight.numel()] = norm.weight
                norm.weight = nn.Parameter(weight, requires_grad=False)
