"""Sequence layouts and the attention metadata built from them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

__all__ = ["AttentionMetadata", "SequenceLayout", "build_metadata"]


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens attend to each other: packed sequences of the given lengths, in order.

    A key (B, S) of uniform tiles is ``SequenceLayout.uniform(B, S)``; packed images of
    different sizes give a layout with different lengths.
    """

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or any(length < 1 for length in self.lengths):
            raise ValueError(f"sequence lengths must be positive, got {list(self.lengths)}")

    @classmethod
    def uniform(cls, batch: int, length: int) -> SequenceLayout:
        """``batch`` sequences of ``length`` tokens each."""
        return cls((length,) * batch)

    @property
    def count(self) -> int:
        """Number of sequences."""
        return len(self.lengths)

    @property
    def total(self) -> int:
        """Number of tokens over all sequences."""
        return sum(self.lengths)

    @property
    def max_length(self) -> int:
        """Length of the longest sequence."""
        return max(self.lengths)

    @property
    def is_uniform(self) -> bool:
        """Whether every sequence has the same length (a dense [B, S] batch)."""
        return len(set(self.lengths)) == 1

    def __str__(self) -> str:
        if self.is_uniform:
            return f"{self.count}x{self.lengths[0]}"
        return "+".join(map(str, self.lengths))


@dataclass(frozen=True)
class AttentionMetadata:
    """What a kernel needs besides q, k and v. Tensors keep their address once captured.

    - ``cu_seqlens``: int32 ``[B + 1]``, the offsets 0, len0, len0 + len1, ..., total;
    - ``seq_lens``: int32 ``[B]``, each sequence's length;
    - ``max_seqlen``: the longest length, a Python int baked into a captured graph.

    A backend that needs none of the tensors gets ``None`` for them.
    """

    max_seqlen: int
    cu_seqlens: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


def build_metadata(
    layout: SequenceLayout, device: torch.device, *, cu_seqlens: bool, seq_lens: bool
) -> AttentionMetadata:
    """Metadata for ``layout`` on ``device`` with the tensors asked for (one host copy each)."""
    offsets = [0, *itertools.accumulate(layout.lengths)]
    return AttentionMetadata(
        max_seqlen=layout.max_length,
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device) if cu_seqlens else None,
        seq_lens=(
            torch.tensor(layout.lengths, dtype=torch.int32, device=device) if seq_lens else None
        ),
    )
