"""The attention backend interface: what a kernel that computes non-causal attention over packed
``[tokens, heads, head_dim]`` q, k and v declares and implements (:mod:`.backends` holds the
built-in ones and how one is chosen).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .layout import AttentionMetadata, PackedLayout, SequenceLayout

__all__ = ["AttentionBackend"]


class AttentionBackend(ABC):
    """One way to compute non-causal attention over packed sequences.

    Subclass it and register an instance through the ``register_attention_backends`` hook;
    :attr:`name` is how adapters' ``attention=`` options and the registry find it, and no two
    registered backends share one (``auto`` is reserved for :func:`choose_backend`).
    """

    name: ClassVar[str]
    needs_workspace: ClassVar[bool] = False
    """Whether the output is written into a caller-owned ``[tokens, heads, head_dim]`` buffer."""
    takes_strided_inputs: ClassVar[bool] = True
    """Whether q, k and v may be strided views (only the last dimension contiguous)."""
    reads_boundaries: ClassVar[bool] = False
    """Whether the kernel reads where sequences start from the metadata's tensors when it
    runs, trusting ``max_seqlen`` as a bound only: then one graph serves every packing of a
    token budget, the metadata written in place before each replay (packed plans)."""
    needs_prepare: ClassVar[bool] = False
    """Whether the backend serves only plans that call :meth:`prepare` once per forward (it
    derives per-call tensors there); packed plans offer it only where they do."""
    largest_room: ClassVar[int | None] = None
    """The most tokens a packed graph's room may hold for this backend (one whose memory grows
    with the square of the room's tokens sets it); ``None``: no limit."""

    def prepare(self, metadata: AttentionMetadata, hidden: torch.Tensor) -> None:
        """Work every attention layer of one forward shares, done once before them, inside
        the graph: a packed plan calls it at the start of its packed forward, with the
        forward's ``[tokens, ...]`` hidden states (their count, dtype and device). Nothing by
        default."""
        return

    @abstractmethod
    def unavailable_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, layout: SequenceLayout
    ) -> str | None:
        """Why this backend cannot run here, or ``None`` if it can."""

    @abstractmethod
    def default_metadata(
        self, layout: SequenceLayout | PackedLayout, device: torch.device
    ) -> AttentionMetadata:
        """The metadata this backend's kernel takes, built for ``layout``: a
        :class:`~layergraph.attention.PackedLayout` only for backends that
        :attr:`reads_boundaries` (zeros sized for its slots, written by the packed plan)."""

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layout: SequenceLayout,
        metadata: AttentionMetadata,
        workspace: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``q`` over ``k`` and ``v`` within each sequence of ``layout``."""

    @property
    def implementation(self) -> str:
        """What actually runs (a kernel or library name), for statistics and reports."""
        return self.name

    @property
    def described(self) -> str:
        """The backend's name, and what runs where that is not the same (``fa3`` with
        PyTorch's kernel: ``"fa3 (torch.nn.attention.varlen.varlen_attn)"``), for statistics
        and reports."""
        if self.implementation == self.name:
            return self.name
        return f"{self.name} ({self.implementation})"
