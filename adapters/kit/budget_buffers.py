"""What every packed family's buffers of one token budget hold, typed for the kit.

A family's buffers class is a dataclass that extends :class:`BudgetBuffers` with what its
graphs read besides (positions, windows); the kit's attention template reads these fields
only. A family declares the host metadata its graphs read per call as :class:`StagedField`
values (name, rows per budget, padding); the kit allocates them in one
:class:`~layergraph.staging.Staging` buffer per budget (:class:`StagedMetadata`) and writes a
call's values into them, padded, in one transfer, only when the call's grids differ from the
last call's (:meth:`BudgetBuffers.load_staged`). :func:`write_padded`, :func:`pad_boundaries`,
:func:`host_boundaries` and :func:`copy_boundaries` are the padding and copying they use, and
:func:`workspace` makes the attention workspace where a backend writes into one.

What it does not do: compute a family's metadata, or load its pixels (each family lays its
patches out its own way).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from layergraph.attention import AttentionBackend, AttentionMetadata
from layergraph.staging import Staging

__all__ = [
    "BudgetBuffers",
    "ImageParts",
    "Padding",
    "StagedField",
    "StagedMetadata",
    "copy_boundaries",
    "host_boundaries",
    "pad_boundaries",
    "workspace",
    "write_padded",
]


class ImageParts(Protocol):
    """What the kit reads of a call's parts (:attr:`~layergraph.packing.PackedCall.parts`) of
    a family whose images each are one sequence: what a family's ``pack`` computes besides."""

    @property
    def counts(self) -> Sequence[int]:
        """The tokens of each image (or frame), in order."""

    @property
    def slots(self) -> int:
        """The image slots of the call's graph (at least its images: ``image_slots``)."""


Padding = Literal["zeros", "ones", "boundaries", "count"]
"""What a staged field holds past a call's rows: zeros; ones; the call's last boundary
repeated (a ``cu_seqlens``: the sequences past the real ones are empty); or each row's own
index (an order over the budget's rows that leaves the rows past the call's in place)."""


@dataclass(frozen=True)
class StagedField:
    """One tensor of per-call host metadata a family's graphs read, declared once."""

    name: str
    rows: Callable[[int, int], int]
    """Its rows in a graph of ``(budget, slots)``: tokens and image slots."""
    dtype: torch.dtype | None = None
    """``None``: the dtype of the first call's value."""
    padding: Padding = "zeros"

    @classmethod
    def per_token(cls, name: str, dtype: torch.dtype | None = None) -> StagedField:
        """A field of one row per token of the budget, zeros past the call's."""
        return cls(name, lambda budget, slots: budget, dtype)

    @classmethod
    def boundaries(cls, name: str = "cu_seqlens") -> StagedField:
        """The call's image boundaries in the budget's slots (int32, ``slots + 1``)."""
        return cls(name, lambda budget, slots: slots + 1, torch.int32, "boundaries")

    def write(self, field: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` into the first rows of ``field``, padded past them."""
        if self.padding == "boundaries":
            pad_boundaries(field, value)
        elif self.padding == "count":
            field[: len(value)] = value
            torch.arange(len(value), len(field), out=field[len(value) :])
        else:
            write_padded(field, value, 1 if self.padding == "ones" else 0)


@dataclass(eq=False)
class StagedMetadata:
    """A budget's declared fields in one staging buffer (device views in :attr:`device`, whose
    addresses never change), and the key of the values they hold."""

    fields: tuple[StagedField, ...]
    staging: Staging
    loaded: Hashable | None = None
    """What the fields were last written for (a call's grids); ``None`` before the first."""

    @classmethod
    def allocate(
        cls,
        fields: Sequence[StagedField],
        budget: int,
        slots: int,
        first: Mapping[str, torch.Tensor],
        device: torch.device,
    ) -> StagedMetadata:
        """The fields of a graph of ``budget`` tokens in ``slots`` slots on ``device``; a field
        without a dtype, and every field's dimensions past its rows, from ``first`` (a
        call's values; a field it lacks has one dimension)."""
        layout = {}
        for spec in fields:
            value = first.get(spec.name)
            dtype = spec.dtype or (value.dtype if value is not None else None)
            if dtype is None:
                raise ValueError(
                    f"staged field {spec.name} has no dtype and no value to take it from"
                )
            rest = () if value is None else tuple(value.shape[1:])
            layout[spec.name] = (dtype, (spec.rows(budget, slots), *rest))
        return cls(tuple(fields), Staging(layout, device))

    @property
    def device(self) -> dict[str, torch.Tensor]:
        """The device views the graph reads, by field name."""
        return self.staging.device

    def load(self, key: Hashable, values: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
        """Write ``values()`` (host tensors, by field name) into the fields and send them in
        one transfer, unless they hold ``key``'s already; whether they were written."""
        if key == self.loaded:
            return False
        host, given = self.staging.host(), values()
        for spec in self.fields:
            spec.write(host[spec.name], given[spec.name])
        self.staging.send()
        self.loaded = key
        return True


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
    staged: StagedMetadata | None = field(default=None, kw_only=True)
    """The family's declared per-call metadata, where it has any."""

    def load_staged(self, key: Hashable, values: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
        """Load a call's metadata into :attr:`staged` (:meth:`StagedMetadata.load`) and copy a
        ``cu_seqlens`` field, as sent, into :attr:`metadata`; whether it was written."""
        if self.staged is None or not self.staged.load(key, values):
            return False
        if "cu_seqlens" in self.staged.device:
            copy_boundaries(self.metadata, self.staged.device["cu_seqlens"])
        return True


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
