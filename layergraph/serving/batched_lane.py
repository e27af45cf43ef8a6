"""The batched lane: which graph serves a batch, for plans keyed by batch size.

With ``batch_sizes="auto"`` a batch is its own key; a batch without a graph of its own goes
the cheapest route over the graphs held (padded up, or in chunks: :mod:`layergraph.serving.policy`)
when measured faster than eager. With fixed sizes a batch is padded up to the smallest bucket
that holds it, or split into chunks of the largest. Graphs may also be captured ahead of time
(:meth:`BatchedLane.capture`), largest first.

What this module does not do: capture, replay or measure (the engine does), or read a call's
arguments (:class:`~layergraph.rows.RowPacking` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..keys import BatchBuckets, CallInputs, ShapeKey
from ..progress import track
from ..rows import NotPerRow, concatenate
from .engine import GraphEngine
from .policy import Route, cheapest_route

__all__ = ["BatchedLane"]


class BatchedLane:
    """Serves batches from graphs keyed by batch size: own graph, bucket, route or chunks."""

    def __init__(self, engine: GraphEngine) -> None:
        self.engine = engine
        self.plan = engine.plan
        self.options = engine.options
        self.buckets = BatchBuckets(None if self.options.measured else self.options.batch_sizes)
        self._routes: dict[Any, tuple[int, Route | None]] = {}
        """The cheapest route over the graphs held, by lookup, with the cache's generation it
        was chosen in (:func:`~layergraph.serving.policy.cheapest_route`)."""

    @property
    def budgets(self) -> tuple[int, ...]:
        """Token budgets: none, for batches."""
        return ()

    def forget(self) -> None:
        """The model changed under the graphs: nothing of the lane's own outlives them (routes
        are chosen again with the cache's next generation)."""

    def token_totals(self) -> tuple[tuple[int, int], ...]:
        """Calls by token total: none, for batches."""
        return ()

    def start_from(self, totals: Sequence[tuple[int, int]], budgets: Sequence[int]) -> None:
        """Learnt token budgets from another process: nothing to start, for batches."""

    def serve(self, call: CallInputs, fresh: bool) -> Any:
        """Serve one call from its bucket's graph; ``fresh`` forces cloned outputs."""
        if self.options.measured:
            return self._serve_measured(call, fresh)
        engine = self.engine
        bucket = self.buckets.bucket_for(call.batch)
        if bucket != call.batch and not self.plan.batch_independent:
            reason = f"batch {call.batch} needs padding or splitting, which this model forbids"
            return self._eager(reason, call)
        if bucket is None:
            largest = self.buckets.largest
            entry, reason = engine.entry_for(largest, call.sliced(0, largest))
        else:
            entry, reason = engine.entry_for(bucket, call)
        if entry is None:
            return self._eager(reason, call)
        if bucket != call.batch and entry.not_per_row is not None:
            return self._eager(
                not_per_row_reason(entry.not_per_row, call.batch, bucket is None), call
            )
        if bucket is None:
            spans = self.buckets.chunks(call.batch)
            buckets = [self.buckets.bucket_for(stop - start) for start, stop in spans]
            return self._serve_chunks(call, spans, "chunks " + "+".join(map(str, buckets)))
        return engine.replay(entry, call, fresh, count=True)

    def _eager(self, reason: str, call: CallInputs) -> Any:
        args, kwargs = call.arguments()
        return self.engine.run_eagerly(reason, args, kwargs, size=call.batch)

    def _serve_measured(self, call: CallInputs, fresh: bool) -> Any:
        """Serve one call the way measured fastest (``batch_sizes="auto"``): its own graph,
        captured if admitted; else the cheapest route over the graphs held, if measured faster
        than eager; else eagerly. A batch's eager time is measured on its first eager call."""
        engine = self.engine
        entry, reason = engine.entry_for(call.batch, call)
        if entry is not None:
            return engine.replay(entry, call, fresh, count=True)
        route = self._held_route(call)
        if route is None:
            return self._eager(reason, call)
        other = f"the graphs held ({route})"
        pays, output = engine.other_way_pays(call, call.batch, reason, route.cost_ms, other)
        if not pays:
            return output
        if len(route.pieces) == 1:
            entry = engine.held.get((route.pieces[0], call.signature))
            return engine.replay(entry, call, fresh, count=True)
        spans = [(start, stop) for start, stop, _ in route.chunks]
        return self._serve_chunks(call, spans, str(route), sizes=route.pieces)

    def _held_route(self, call: CallInputs) -> Route | None:
        """The cheapest way to serve ``call`` with the graphs held for its signature (padded,
        or in chunks), or ``None`` if none may; chosen again whenever the graphs change."""
        if not self.plan.batch_independent:
            return None
        cache = self.engine.held
        lookup = (call.batch, call.signature)
        chosen = self._routes.get(lookup)
        if chosen is not None and chosen[0] == cache.generation:
            return chosen[1]
        graph_ms = {
            batch: entry.costs.graph_ms
            for batch, entry in cache.held_with(call.signature).items()
            if entry.not_per_row is None
            and entry.costs is not None
            and entry.costs.graph_ms is not None
        }
        route = cheapest_route(call.batch, graph_ms)
        if len(self._routes) >= 4 * self.engine.max_graphs + 64:
            self._routes.clear()
        self._routes[lookup] = (cache.generation, route)
        return route

    def _serve_chunks(
        self,
        call: CallInputs,
        spans: Sequence[tuple[int, int]],
        described: str,
        sizes: Sequence[int] | None = None,
    ) -> Any:
        """Rows ``spans`` of the call, each served by a graph (of ``sizes``, in order, or its
        bucket's) and its output cloned before the next replays; the outputs joined.

        Outputs the chunks cannot be joined by (not one row per input in some chunk's graph)
        send the whole call to eager instead.
        """
        engine = self.engine
        chunks = [call.sliced(start, stop) for start, stop in spans]
        if sizes is None:
            parts = [self.serve(chunk, fresh=True) for chunk in chunks]
        else:
            parts = [
                engine.replay(engine.held.get((size, chunk.signature)), chunk, fresh=True)
                for chunk, size in zip(chunks, sizes)
            ]
        try:
            joined = concatenate(parts, [chunk.batch for chunk in chunks])
        except NotPerRow as problem:
            return self._eager(not_per_row_reason(str(problem), call.batch, split=True), call)
        engine.stats.split_calls += 1
        engine.stats.served[(call.batch, described)] += 1
        return joined

    def capture(
        self, call: CallInputs, batch_sizes: Sequence[int] | None, progress: bool
    ) -> list[ShapeKey]:
        """Capture graphs now for ``call``'s sequence, largest batch first (see
        :meth:`~layergraph.runner.GraphRunner.capture`). Called under the engine's lock."""
        engine = self.engine
        self.plan.check_inputs(call)
        sizes = batch_sizes if batch_sizes is not None else self.buckets.sizes or (call.batch,)
        sizes = sorted(BatchBuckets(sizes).sizes or (), reverse=True)
        keys = []
        for size in track(sizes, "capturing graphs", enabled=progress):
            rows = torch.arange(size, device=call.tensors[0].device) % call.batch
            example = CallInputs(*call.rebuild([t[rows] for t in call.tensors]))
            entry = engine.capture_ahead(size, example, len(sizes))
            if entry is not None:
                keys.append(entry.key)
        return keys


def not_per_row_reason(problem: str, batch: int, split: bool) -> str:
    """The eager reason of a call that would pad or split outputs that are not one row per
    input."""
    return (
        f"outputs are not one row per input ({problem}): "
        f"batch {batch} is not {'split' if split else 'padded'}"
    )
