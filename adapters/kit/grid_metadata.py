"""The host metadata of a call of a tower that takes ``grid_thw`` (the Qwen and GLM towers):
boundaries, rotary positions, windows and learned-position rows, computed once per grid entry
and composed per call.

A family computes an entry's metadata with transformers' own ``vision_utils`` functions on a
one-row ``grid_thw``; :class:`GridMetadataCache` keeps each entry's and joins them for a call
of several entries. Every such function treats the entries of ``grid_thw`` one after another
and independently, so the joined tensors equal what the function gives for the whole grid,
element for element: rows concatenated, indices shifted by the rows before them, boundaries
shifted by the tokens before them. A call of sizes seen before costs the concatenations, not
the functions.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["GridMetadata", "GridMetadataCache", "join_boundaries"]

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class GridMetadata:
    """A call's (or one entry's) host metadata: what the tower's forward takes precomputed."""

    position_ids: torch.Tensor
    """Each patch's rotary position, a row per patch."""
    cu_seqlens: torch.Tensor
    """Frame boundaries (int32, from 0)."""
    window_index: torch.Tensor | None = None
    """The merged tokens' order by window (an index of the call's merged tokens)."""
    cu_window_seqlens: torch.Tensor | None = None
    """Window boundaries, in patches (int32, from 0); both ``None`` for a tower without
    windows."""
    interp_indices: torch.Tensor | None = None
    interp_weights: torch.Tensor | None = None
    """Each patch's rows of a learned position table and their weights, a row per patch; both
    ``None`` for a tower without learned positions."""


def join_boundaries(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Boundaries (each from 0, strictly increasing) of consecutive spans as one: each part
    after the first shifted by where the ones before it end."""
    if len(parts) == 1:
        return parts[0]
    ends = [0, *itertools.accumulate(int(part[-1]) for part in parts[:-1])]
    shifted = [parts[0], *(part[1:] + end for part, end in zip(parts[1:], ends[1:]))]
    return torch.cat(shifted)


def _join_indices(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Indices into each part's own rows as indices into the rows of all parts in order."""
    starts = itertools.accumulate((part.numel() for part in parts[:-1]), initial=0)
    return torch.cat([part + start for part, start in zip(parts, starts)])


def _join(parts: Sequence[GridMetadata]) -> GridMetadata:
    """The metadata of consecutive entries as that of one call."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]

    def rows(name: str) -> torch.Tensor | None:
        if getattr(first, name) is None:
            return None
        return torch.cat([getattr(part, name) for part in parts])

    windows = first.window_index is not None
    return GridMetadata(
        position_ids=torch.cat([part.position_ids for part in parts]),
        cu_seqlens=join_boundaries([part.cu_seqlens for part in parts]),
        window_index=_join_indices([part.window_index for part in parts]) if windows else None,
        cu_window_seqlens=(
            join_boundaries([part.cu_window_seqlens for part in parts]) if windows else None
        ),
        interp_indices=rows("interp_indices"),
        interp_weights=rows("interp_weights"),
    )


class GridMetadataCache:
    """A call's metadata from its grid entries: each entry's computed once by ``compute``
    (given a one-row ``grid_thw`` on the host) and kept, the last ``kept_entries`` of them;
    the joined metadata of the last ``kept_calls`` calls kept whole as well."""

    def __init__(
        self,
        compute: Callable[[torch.Tensor], GridMetadata],
        kept_entries: int = 256,
        kept_calls: int = 32,
    ) -> None:
        self._compute = compute
        self._entries: OrderedDict[Grid, GridMetadata] = OrderedDict()
        self._calls: OrderedDict[tuple[Grid, ...], GridMetadata] = OrderedDict()
        self._kept_entries = kept_entries
        self._kept_calls = kept_calls

    def __call__(self, grids: tuple[Grid, ...]) -> GridMetadata:
        """The metadata of a call of ``grids`` (its ``grid_thw`` rows, in order)."""
        found = _recent(self._calls, grids, self._kept_calls)
        if found is None:
            found = _join([self._entry(grid) for grid in grids])
            self._calls[grids] = found
        return found

    def _entry(self, grid: Grid) -> GridMetadata:
        found = _recent(self._entries, grid, self._kept_entries)
        if found is None:
            found = self._compute(torch.tensor([grid]))
            self._entries[grid] = found
        return found


def _recent(kept: OrderedDict, key: object, most: int) -> GridMetadata | None:
    """``kept[key]`` made the most recent, or ``None`` (room made for it, the oldest dropped,
    where ``kept`` holds ``most``)."""
    found = kept.pop(key, None)
    if found is not None:
        kept[key] = found
    elif len(kept) >= most:
        kept.popitem(last=False)
    return found
