"""The graphs of one wrapped model: a bounded store with an admission rule.

A stream of odd shapes must not exhaust the GPU: at most ``max_graphs`` graphs are held, the
least recently used dropped first, and a shape is captured only once it has been seen
``capture_after`` times (the count of sightings is itself bounded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .guards import HeldOutputs
from .keys import ShapeKey

__all__ = ["GraphCache", "GraphEntry"]

_SIGHTINGS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class GraphEntry:
    """One captured graph and the buffers whose addresses it baked in."""

    key: ShapeKey
    graph: Any
    static_inputs: tuple[torch.Tensor, ...]
    output_leaves: tuple[Any, ...]
    output_spec: pytree.TreeSpec
    batched_outputs: tuple[bool, ...] = field(repr=False)
    state: Any = field(default=None, repr=False)
    """The plan's per-key buffers (attention metadata, workspaces), kept alive with the graph."""
    addresses: tuple[int, ...] = field(default=(), repr=False)
    """Data pointers of every buffer the graph reads or writes, as captured (debug checks)."""
    held: HeldOutputs = field(default_factory=HeldOutputs, repr=False)
    """The outputs handed out by the last replay, when they are the graph's own buffers."""


class GraphCache:
    """Graph entries by (bucket, call signature), least recently used first out."""

    def __init__(self, max_graphs: int, capture_after: int) -> None:
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self._entries: OrderedDict[Hashable, GraphEntry] = OrderedDict()
        self._sightings: OrderedDict[Hashable, int] = OrderedDict()

    def get(self, lookup: Hashable) -> GraphEntry | None:
        """The entry for ``lookup``, now the most recently used; ``None`` if absent."""
        entry = self._entries.get(lookup)
        if entry is not None:
            self._entries.move_to_end(lookup)
        return entry

    def admit(self, lookup: Hashable) -> int | None:
        """Count a sighting of ``lookup``; ``None`` if it may be captured now, else the count."""
        seen = self._sightings.pop(lookup, 0) + 1
        if seen >= self.capture_after:
            return None
        self._sightings[lookup] = seen
        if len(self._sightings) > _SIGHTINGS_KEPT:
            self._sightings.popitem(last=False)
        return seen

    def add(self, lookup: Hashable, entry: GraphEntry) -> GraphEntry | None:
        """Store ``entry``; return the least recently used entry it displaced, if any."""
        evicted = None
        if lookup not in self._entries and len(self._entries) >= self.max_graphs:
            _, evicted = self._entries.popitem(last=False)
        self._entries[lookup] = entry
        return evicted

    def remove(self, lookup: Hashable) -> None:
        self._entries.pop(lookup, None)

    def clear(self) -> None:
        self._entries.clear()
        self._sightings.clear()

    def __contains__(self, lookup: Hashable) -> bool:
        return lookup in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[GraphEntry]:
        return iter(list(self._entries.values()))
