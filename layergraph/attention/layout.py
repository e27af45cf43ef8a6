"""Sequence layouts and the attention metadata built from them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

__all__ = [
    "AttentionMetadata",
    "PackedLayout",
    "SequenceLayout",
    "build_metadata",
    "check_packed_metadata",
    "padded_offsets",
]


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
class PackedLayout:
    """Room for packed sequences whose lengths change from call to call: at most ``slots``
    sequences of at most ``max_length`` tokens each, ``tokens`` in all.

    The layout of one graph of a packed plan (a token budget, :mod:`layergraph.packing`): its
    metadata is built once, with tensors sized for these capacities, and the plan writes each
    call's boundaries into ``cu_seqlens`` (and ``seq_lens``, when the backend takes them) in
    place before every replay. Slots past the call's sequences are empty: they start and end
    at its last real token, and the tokens past it (padding) belong to no sequence. Only
    backends that read boundaries when they run
    (:attr:`~layergraph.attention.AttentionBackend.reads_boundaries`) serve such layouts.
    """

    tokens: int
    slots: int
    max_length: int

    def __post_init__(self) -> None:
        if min(self.tokens, self.slots, self.max_length) < 1 or self.max_length > self.tokens:
            raise ValueError(
                f"a packed layout needs positive tokens, slots and max_length, max_length at "
                f"most tokens; got {self}"
            )

    def __str__(self) -> str:
        return f"up to {self.slots} sequences of up to {self.max_length} in {self.tokens} tokens"


@dataclass(frozen=True)
class AttentionMetadata:
    """What a kernel needs besides q, k and v. Tensors keep their address once captured.

    - ``cu_seqlens``: int32 ``[B + 1]``, the offsets 0, len0, len0 + len1, ..., total;
    - ``seq_lens``: int32 ``[B]``, each sequence's length;
    - ``max_seqlen``: the longest length, a Python int baked into a captured graph;
    - ``scratch``: buffers a backend keeps with the metadata, made by its
      :meth:`~layergraph.attention.AttentionBackend.prepare` on first use (a graph's warm-up),
      so that they keep their address in the graph (the dense backend's block mask).

    A backend that needs none of the tensors gets ``None`` for them.
    """

    max_seqlen: int
    cu_seqlens: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


def build_metadata(
    layout: SequenceLayout | PackedLayout,
    device: torch.device,
    *,
    cu_seqlens: bool,
    seq_lens: bool,
) -> AttentionMetadata:
    """Metadata for ``layout`` on ``device`` with the tensors asked for: a sequence layout's
    boundaries (one host copy each), or zeros sized for a packed layout's slots, which its
    plan writes before every replay."""
    if isinstance(layout, PackedLayout):
        return AttentionMetadata(
            max_seqlen=layout.max_length,
            cu_seqlens=(
                torch.zeros(layout.slots + 1, dtype=torch.int32, device=device)
                if cu_seqlens
                else None
            ),
            seq_lens=(
                torch.zeros(layout.slots, dtype=torch.int32, device=device) if seq_lens else None
            ),
        )
    offsets = [0, *itertools.accumulate(layout.lengths)]
    return AttentionMetadata(
        max_seqlen=layout.max_length,
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device) if cu_seqlens else None,
        seq_lens=(
            torch.tensor(layout.lengths, dtype=torch.int32, device=device) if seq_lens else None
        ),
    )


def check_packed_metadata(metadata: AttentionMetadata, layout: PackedLayout, source: str) -> None:
    """Raise ``ValueError`` naming ``source`` unless ``metadata`` can hold every call of a
    packed ``layout``: int32 ``cu_seqlens`` of ``slots + 1`` elements, ``seq_lens`` absent or
    int32 of ``slots``, and ``max_seqlen`` at least the layout's ``max_length``."""
    problems = []
    for name, size in (("cu_seqlens", layout.slots + 1), ("seq_lens", layout.slots)):
        tensor = getattr(metadata, name)
        if tensor is None and name == "seq_lens":
            continue
        if tensor is None or tensor.dtype != torch.int32 or tensor.shape != (size,):
            described = "none" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
            problems.append(f"{name} must be int32 of shape ({size},), got {described}")
    if not isinstance(metadata.max_seqlen, int) or metadata.max_seqlen < layout.max_length:
        problems.append(f"max_seqlen must be an int of at least {layout.max_length}")
    if problems:
        raise ValueError(
            f"attention metadata from {source} cannot hold calls of {layout}: "
            + "; ".join(problems)
        )


def padded_offsets(lengths: tuple[int, ...] | list[int], slots: int) -> torch.Tensor:
    """int32 ``cu_seqlens`` of ``slots`` sequences on the host: ``lengths`` first, then empty
    sequences at the end of the last (a packed call's padding belongs to none)."""
    if len(lengths) > slots:
        raise ValueError(f"{len(lengths)} sequences do not fit {slots} slots")
    offsets = torch.zeros(slots + 1, dtype=torch.int32)
    offsets[1 : len(lengths) + 1] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    offsets[len(lengths) + 1 :] = offsets[len(lengths)]
    return offsets
