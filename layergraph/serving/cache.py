"""The graphs of one wrapped model, and everything the runner knows about each key.

A stream of odd shapes must not exhaust the GPU, nor keep it capturing: at most ``max_graphs``
graphs are held, and a shape is captured only once it has been seen ``capture_after`` times.
When all ``max_graphs`` are held, a shape displaces the least used graph only if it has been
seen more often than that graph has been replayed; otherwise its calls run eagerly. Counts
are halved every :data:`_HALVE_EVERY` calls, so that they follow traffic that changes. (Left
to drop the least recently used graph instead, a stream of more sizes than ``max_graphs``
captured and evicted a graph on almost every call.)

Everything known about one lookup (a bucket and a call signature) lives in :class:`GraphCache`,
in exactly one of its tables: a graph (:class:`GraphEntry`, which carries what replays learn
about it, :class:`ReplayRecord`), a count of sightings, or the reason its capture failed;
and beside them, its FLOPs, counted at its first capture.
Dropping a graph therefore forgets all there was to know about it: a key captured again is
validated again. Measured costs (:class:`~layergraph.serving.policy.Costs`) are about the shape, not
the graph: they live on the entry while it lives, and in a table of their own after (a graph
not measured faster than eager is not captured again), until the model changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from ..guards import HeldOutputs
from ..keys import ShapeKey
from .policy import Costs, FusionChoice

__all__ = ["GraphCache", "GraphEntry", "HeldGraphs", "ReplayRecord", "aliases", "storages"]

_SIGHTINGS_KEPT = 4096
_HALVE_EVERY = 1024
"""Calls after which every count (sightings and graphs' uses) is halved."""


@dataclass(slots=True)
class ReplayRecord:
    """What replays of one graph have established; created with the graph, dropped with it."""

    validated: bool = False
    """Whether a replay was compared with eager and agreed (``validate=True``)."""
    uses: int = 0
    """Calls that needed this graph (its sightings before capture included), halved with
    every other count; what a shape without a graph must exceed to displace it."""
    held: HeldOutputs = field(default_factory=HeldOutputs)
    """The outputs handed out by the last replay, when they are the graph's own buffers."""


@dataclass(frozen=True, slots=True)
class GraphEntry:
    """One captured graph, the buffers whose addresses it baked in, and what replays learnt."""

    key: ShapeKey
    graph: Any
    buffers: Any
    """The packing's buffers the graph reads (inputs, attention metadata, workspaces), kept
    alive with it (:meth:`~layergraph.packing.Packing.allocate`)."""
    output_leaves: tuple[Any, ...]
    """The graph's output buffers, flattened."""
    output_spec: pytree.TreeSpec
    not_per_row: str | None = field(default=None, repr=False)
    """Why the outputs are not one row per input (``"output 0 is 0-d"``), or ``None`` when
    every tensor output has one row per input row. Such a graph serves only calls of exactly
    its batch: padding or splitting would change what is computed over the batch."""
    addresses: tuple[int, ...] = field(default=(), repr=False)
    """Data pointers of every buffer the graph reads or writes, as captured (debug checks)."""
    storages: frozenset[int] = field(default=frozenset(), repr=False)
    """The storages of the graph's outputs and buffers (their data pointers): a cut output
    in none of them is the call's own and needs no clone."""
    costs: Costs | None = None
    """Its replay and an eager call of its batch, measured at capture; ``None`` for a packed
    budget captured ahead of its calls until the first of them measures it."""
    record: ReplayRecord = field(default_factory=ReplayRecord, repr=False)
    """The mutable part: validation and held outputs."""
    fusion: FusionChoice | None = None
    """Whether it holds the layers compiled or as built, and why, once decided
    (:class:`~layergraph.serving.fusion.LayerFusion`); ``None`` before, or without compiled
    layers chosen by measurement."""


class GraphCache:
    """Graph entries by lookup (bucket, call signature), the least used displaced first; the
    sightings of lookups not captured yet; the lookups whose capture failed.

    A lookup is in at most one of the three tables once a call is done: storing its graph
    (:meth:`add`, after :meth:`admit` said yes) takes it out of the sightings, its count
    becoming the graph's uses; :meth:`fail` records a lookup that has no graph.
    """

    def __init__(self, max_graphs: int, capture_after: int) -> None:
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self._graphs: OrderedDict[Hashable, GraphEntry] = OrderedDict()
        """Captured graphs, least recently used first (:meth:`get` moves one to the end), so
        that among equally used graphs :meth:`add` drops the least recently used. An entry
        holds all there is to know about its graph (buffers, the plan's per-key state,
        validation, uses, held outputs): removing it forgets all of that, and nothing else
        refers to the lookup."""
        self._sightings: OrderedDict[Hashable, int] = OrderedDict()
        """Calls seen of each lookup without a graph (halved with every count); least recently
        seen first, so that the oldest is forgotten beyond ``_SIGHTINGS_KEPT`` lookups."""
        self._failures: dict[Hashable, str] = {}
        """Why capturing each lookup failed (it ran out of device memory, or the capture
        raised what eager runs did not): such a lookup runs eagerly until :meth:`clear`. Few:
        one per shape that cannot be captured."""
        self._costs: OrderedDict[Hashable, Costs] = OrderedDict()
        """Measured costs of lookups without a graph (never captured, displaced, or not measured
        faster than eager), least recently measured first."""
        self._flops: OrderedDict[Hashable, int] = OrderedDict()
        """The FLOPs of each lookup's graph (its budget's work, padding included), counted at
        its first capture (:func:`~layergraph.flops.count_flops`), least recently counted
        first."""
        self._calls = 0
        """Calls counted since the cache was made, for halving the counts."""
        self.generation = 0
        """Counts changes to the set of graphs held, so that decisions taken over that set
        (the policy's routes) know when to be taken again."""

    def get(self, lookup: Hashable) -> GraphEntry | None:
        """The entry for ``lookup``, now the most recently used, its use counted; ``None`` if
        absent (the caller then asks :meth:`admit`)."""
        entry = self._graphs.get(lookup)
        if entry is not None:
            self._graphs.move_to_end(lookup)
            entry.record.uses += 1
            self._count_call()
        return entry

    def failure(self, lookup: Hashable) -> str | None:
        """Why capturing ``lookup`` failed, or ``None`` if it did not."""
        return self._failures.get(lookup)

    def admit(self, lookup: Hashable) -> str | None:
        """Count a sighting of ``lookup``, which has no graph; ``None`` if it may be captured
        now, else why its call runs eagerly."""
        seen = self._sightings.pop(lookup, 0) + 1
        self._sightings[lookup] = seen
        if len(self._sightings) > _SIGHTINGS_KEPT:
            self._sightings.popitem(last=False)
        self._count_call()
        if seen < self.capture_after:
            return f"shape not yet seen {self.capture_after} times (capture_after)"
        victim = self._victim()
        if victim is not None and seen <= self._graphs[victim].record.uses:
            return (
                f"shape seen no more often than each of the {self.max_graphs} graphs held is "
                f"used (max_graphs)"
            )
        return None

    def add(self, lookup: Hashable, entry: GraphEntry) -> GraphEntry | None:
        """Store ``entry``, its uses starting at the lookup's sightings; return the entry it
        displaced (the least used, the least recently used among equals), if any."""
        evicted = None
        if lookup not in self._graphs:
            victim = self._victim()
            if victim is not None:
                evicted = self._graphs.pop(victim)
                self._keep_costs(victim, evicted)
        entry.record.uses = self._sightings.pop(lookup, 0)
        self._costs.pop(lookup, None)
        self._graphs[lookup] = entry
        self.generation += 1
        return evicted

    def swap(self, lookup: Hashable, entry: GraphEntry) -> GraphEntry:
        """Put ``entry`` in place of the graph held for ``lookup`` (the same key, captured
        another way or decided); return it."""
        if lookup not in self._graphs:
            raise KeyError(f"no graph held for {lookup!r}")
        self._graphs[lookup] = entry
        self.generation += 1
        return entry

    def sightings(self, lookup: Hashable) -> int:
        """Calls counted of ``lookup`` without a graph (as halved)."""
        return self._sightings.get(lookup, 0)

    def keep_if_it_pays(self, lookup: Hashable, costs: Costs) -> GraphEntry | None:
        """Give the graph of ``lookup``, stored unmeasured, its ``costs``: return the entry
        that holds them if the graph pays, else drop it (the costs kept) and return ``None``."""
        entry = self._graphs[lookup]
        if not costs.graph_pays:
            self.remove(lookup)
            self.record_costs(lookup, costs)
            return None
        settled = replace(entry, costs=costs)
        self._graphs[lookup] = settled
        self.generation += 1
        return settled

    def costs(self, lookup: Hashable) -> Costs | None:
        """What was measured of ``lookup``, with or without a graph; ``None`` if nothing."""
        entry = self._graphs.get(lookup)
        if entry is not None:
            return entry.costs
        return self._costs.get(lookup)

    def record_costs(self, lookup: Hashable, costs: Costs) -> None:
        """Record ``costs`` of ``lookup``, which has no graph."""
        self._costs.pop(lookup, None)
        self._costs[lookup] = costs
        if len(self._costs) > _SIGHTINGS_KEPT:
            self._costs.popitem(last=False)

    def flops(self, lookup: Hashable) -> int | None:
        """The FLOPs of ``lookup``'s graph, or ``None`` if not counted."""
        return self._flops.get(lookup)

    def record_flops(self, lookup: Hashable, flops: int) -> None:
        """Record the FLOPs of ``lookup``'s graph."""
        self._flops[lookup] = flops
        if len(self._flops) > _SIGHTINGS_KEPT:
            self._flops.popitem(last=False)

    def flops_by_batch(self) -> dict[int, int]:
        """The FLOPs counted, by batch size or token budget (of the lookups of one size, the
        one counted last)."""
        return dict(sorted({lookup[0]: flops for lookup, flops in self._flops.items()}.items()))

    def held_with(self, signature: Hashable) -> dict[int, GraphEntry]:
        """The graphs held for calls of ``signature``, by their batch size."""
        return {bucket: entry for (bucket, sig), entry in self._graphs.items() if sig == signature}

    def all_costs(self) -> dict[Hashable, Costs]:
        """Every measurement, by lookup, with a graph held or not."""
        measured = dict(self._costs)
        measured.update(
            (lookup, entry.costs) for lookup, entry in self._graphs.items() if entry.costs
        )
        return measured

    def costs_by_batch(self) -> dict[int, Costs]:
        """Every measurement, with a graph held or not, by batch size (of the lookups of one
        batch size, the one measured last)."""
        measured = {lookup[0]: costs for lookup, costs in self.all_costs().items()}
        return dict(sorted(measured.items()))

    def _keep_costs(self, lookup: Hashable, entry: GraphEntry) -> None:
        if entry.costs is not None:
            self.record_costs(lookup, entry.costs)

    def _victim(self) -> Hashable | None:
        """The graph a new one would displace when ``max_graphs`` are held, else ``None``."""
        if len(self._graphs) < self.max_graphs:
            return None
        return min(self._graphs, key=lambda lookup: self._graphs[lookup].record.uses)

    def _count_call(self) -> None:
        """Count one call; every :data:`_HALVE_EVERY` calls, halve every count."""
        self._calls += 1
        if self._calls % _HALVE_EVERY:
            return
        for entry in self._graphs.values():
            entry.record.uses //= 2
        for lookup in list(self._sightings):
            self._sightings[lookup] //= 2

    def fail(self, lookup: Hashable, reason: str) -> None:
        """Record that capturing ``lookup`` failed for ``reason``; it must have no graph."""
        self._sightings.pop(lookup, None)
        self._failures[lookup] = reason

    def remove(self, lookup: Hashable) -> None:
        """Drop the graph of ``lookup``, if any, with all that was known about it."""
        if self._graphs.pop(lookup, None) is not None:
            self.generation += 1

    def keep_buckets(self, buckets: Collection[int]) -> int:
        """Drop the graphs of every bucket not in ``buckets`` (their measured costs kept);
        return how many were dropped."""
        dropped = [lookup for lookup in self._graphs if lookup[0] not in buckets]
        for lookup in dropped:
            self._keep_costs(lookup, self._graphs.pop(lookup))
        if dropped:
            self.generation += 1
        return len(dropped)

    def drop_graphs(self) -> None:
        """Drop every graph; sightings, failures and measured costs stay."""
        for lookup, entry in self._graphs.items():
            self._keep_costs(lookup, entry)
        self._graphs.clear()
        self.generation += 1

    def clear(self) -> None:
        """Forget everything: graphs, sightings, failures, measured costs and FLOPs."""
        self._graphs.clear()
        self._sightings.clear()
        self._failures.clear()
        self._costs.clear()
        self._flops.clear()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._graphs)

    def __iter__(self) -> Iterator[GraphEntry]:
        return iter(list(self._graphs.values()))

    def items(self) -> list[tuple[Hashable, GraphEntry]]:
        """Every graph held, with its lookup, least recently used first; uses not counted."""
        return list(self._graphs.items())


class HeldGraphs(Protocol):
    """What the lanes and the façade read of the graphs held (:attr:`GraphEngine.held
    <layergraph.serving.engine.GraphEngine.held>`); capturing, dropping and measuring go through the
    engine alone."""

    generation: int
    """Counts changes to the graphs held: a choice made over them holds while it is equal."""

    def get(self, lookup: Hashable) -> GraphEntry | None: ...
    def failure(self, lookup: Hashable) -> str | None: ...
    def sightings(self, lookup: Hashable) -> int: ...
    def costs(self, lookup: Hashable) -> Costs | None: ...
    def held_with(self, signature: Hashable) -> dict[int, GraphEntry]: ...
    def all_costs(self) -> dict[Hashable, Costs]: ...
    def costs_by_batch(self) -> dict[int, Costs]: ...
    def flops(self, lookup: Hashable) -> int | None: ...
    def flops_by_batch(self) -> dict[int, int]: ...
    def items(self) -> list[tuple[Hashable, GraphEntry]]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[GraphEntry]: ...


def storages(tensors: Sequence[Any]) -> frozenset[int]:
    """The data pointers of the storages of the tensors among ``tensors``."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor))


def aliases(leaf: Any, owned: frozenset[int]) -> bool:
    """Whether ``leaf`` is a tensor whose storage is one of ``owned`` (a graph's buffers)."""
    return isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() in owned
