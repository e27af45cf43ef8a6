"""What every packed family's buffers of one token budget hold, typed for the kit.

A family's buffers class is a dataclass that extends :class:`BudgetBuffers` with what its
graphs read besides (positions, windows, staging); the kit's attention template reads these
fields only. :func:`write_padded` is the one way a family writes a host field of a call into
its staging buffer; :func:`pad_boundaries`, :func:`host_boundaries` and
:func:`copy_boundaries` lay out and copy a call's sequence boundaries in the budget's image
slots, and :func:`workspace` makes the attention workspace where a backend writes into one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from layergraph.attention import AttentionBackend, AttentionMetadata

__all__ = [
    "BudgetBuffers",
    "copy_boundaries",
    "host_boundaries",
    "pad_boundaries",
    "workspace",
    "write_padded",
]


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


def host_boundaries(counts: Sequence[int], slots: int) -> torch.Tensor:
    """The ``cu_seqlens`` of sequences of ``counts`` tokens in ``slots`` slots, on the host
    (int32): the slots past them empty, at the last real token (:func:`pad_boundaries`)."""
    offsets = torch.zeros(slots + 1, dtype=torch.int32)
    pad_boundaries(offsets, torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32))
    return offsets


def pad_boundaries(field: torch.Tensor, offsets: torch.Tensor) -> None:
    """Write a call's boundaries ``offsets`` (from 0) into ``field``, a budget's slots and one:
    the sequences past the real ones are empty, starting and ending at the last real token."""
    field[: offsets.numel()] = offsets
    field[offsets.numel() :] = offsets[-1]


def copy_boundaries(metadata: AttentionMetadata, boundaries: torch.Tensor) -> None:
    """Copy boundaries (on the device, or the host) into the attention metadata's own tensors
    (a plugin's hook may have made them), and the sequences' lengths where it has them."""
    metadata.cu_seqlens.copy_(boundaries)
    if metadata.seq_lens is None:
        return
    if boundaries.device == metadata.seq_lens.device:
        torch.sub(boundaries[1:], boundaries[:-1], out=metadata.seq_lens)
    else:
        metadata.seq_lens.copy_(boundaries.diff())


def workspace(
    budget: int, heads: int, head_dim: int, like: torch.Tensor, *backends: AttentionBackend
) -> torch.Tensor | None:
    """The ``[budget, heads, head_dim]`` buffer the backends write into, where any of them
    needs one (of ``like``'s dtype and device); ``None`` otherwise."""
    if not any(backend.needs_workspace for backend in backends):
        return None
    return torch.zeros(budget, heads, head_dim, dtype=like.dtype, device=like.device)
