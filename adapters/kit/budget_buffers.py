"""What every packed family's buffers of one token budget hold, typed for the kit.

A family's buffers class is a dataclass that extends :class:`BudgetBuffers` with what its
graphs read besides (positions, windows, staging); the kit's attention template reads these
fields only. :func:`write_padded` is the one way a family writes a host field of a call into
its staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layergraph.attention import AttentionBackend, AttentionMetadata

__all__ = ["BudgetBuffers", "write_padded"]


@dataclass(eq=False)
class BudgetBuffers:
    """One budget's buffers, written in place before every replay."""

    budget: int
    """The tokens the graph holds."""
    pixels: torch.Tensor
    """``[budget, features]``: the call's real patches, zeros past them."""
    metadata: AttentionMetadata
    """The attention metadata over the budget's images (for a tower with windows, its
    full-attention layers')."""
    backend: AttentionBackend
    """The backend :attr:`metadata` is for."""
    workspace: torch.Tensor | None
    """Where the backend writes its output, for a backend that writes into one."""


def write_padded(field: torch.Tensor, rows: torch.Tensor, fill: float | torch.Tensor = 0) -> None:
    """``rows`` into the first rows of ``field``, ``fill`` past them."""
    count = rows.shape[0]
    field[:count] = rows
    field[count:] = fill if not isinstance(fill, torch.Tensor) else fill[count:]
