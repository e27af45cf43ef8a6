"""The measured shape policy: how each batch size is served, chosen by measured cost.

A call of ``b`` rows can be served by a graph captured for exactly ``b`` rows, by the graph of
a larger batch with the call padded up to it, by several graphs one after the other (chunks),
or eagerly. Which is fastest depends on the model, the GPU and the batch: a graph saves the
launches of hundreds of kernels, which pays most at small batches and next to nothing once
the GPU is busy, while padding 13 rows to 16 costs 23 % more work. With
``batch_sizes="auto"`` (the default of :func:`layergraph.wrap`) the runner measures instead
of assuming:

- every batch size that comes gets a graph of its own, while graphs may be added
  (``max_graphs``; a frequent size displaces a rarer one,
  :class:`~layergraph.serving.cache.GraphCache`);
- each capture measures the graph's replay and an eager call of the same batch
  (:class:`Costs`); a graph not measured faster than eager by a margin
  (:data:`GRAPH_MARGIN`) is dropped, and its batch runs eagerly;
- a batch without a graph of its own is served by the cheapest combination of the graphs
  held (:func:`cheapest_route`) when that is measured faster than eager by a margin
  (:data:`ROUTE_MARGIN`), else eagerly. Its eager time is measured on its first eager call.

Packed plans (:mod:`layergraph.packing`) are served the same way, with token budgets in place
of batch sizes: a call of ``t`` tokens goes to the budget chosen for it from the traffic
(:mod:`layergraph.serving.budgets`), captured if admitted and kept only if measured faster than
eager; without a graph there, to the cheapest larger budget held, if measured faster than eager by
the same margin; else it runs eagerly.

With compiled layers chosen by measurement (``compile_layers="auto"``,
:class:`~layergraph.serving.fusion.LayerFusion`), each key held is captured a second time with
its layers compiled once compiled code is ready, and keeps the compiled graph only if its replay
measures under :data:`FUSION_MARGIN` of the graph as the adapter built it
(:func:`fusion_choice`).

This module holds the decision only: it knows batch sizes and milliseconds, never graphs or
tensors, so all of it runs and is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FUSION_MARGIN",
    "GRAPH_MARGIN",
    "ROUTE_MARGIN",
    "Costs",
    "FusionChoice",
    "Route",
    "cheapest_route",
    "fusion_choice",
]

GRAPH_MARGIN = 0.98
"""A batch's own graph is kept only if its replay measures under this share of the batch's
eager time: nearer parity a few timed calls cannot tell the two apart, and eager holds no
pool memory."""

ROUTE_MARGIN = 0.95
"""A batch goes through other graphs (padded, or in chunks) only if their replays sum to less
than this share of its eager time: that sum adds measurements of other batches, and near
parity a single call is safer than several."""

FUSION_MARGIN = 0.97
"""A key's graph with compiled layers replaces its graph as built only if its replay measures
under this share of the other's: compiling pays at start and in memory, and near parity a few
timed replays cannot tell the two apart."""


@dataclass(frozen=True, slots=True)
class Costs:
    """Measured milliseconds of a call of one batch size, each waited for (host work and the
    device's, as a caller that needs the result feels them)."""

    eager_ms: float
    """The model run eagerly on that batch."""
    graph_ms: float | None = None
    """A replay of the graph captured for that batch (input copies included); ``None`` while
    no graph of the batch was measured."""

    @property
    def graph_pays(self) -> bool:
        """Whether the batch's own graph was measured faster than eager by the margin
        (:data:`GRAPH_MARGIN`)."""
        return self.graph_ms is not None and self.graph_ms < GRAPH_MARGIN * self.eager_ms

    def __str__(self) -> str:
        if self.graph_ms is None:
            return f"eager {self.eager_ms:.3f} ms, no graph"
        return f"eager {self.eager_ms:.3f} ms, graph {self.graph_ms:.3f} ms"


@dataclass(frozen=True, slots=True)
class Route:
    """Graphs that serve a call of ``batch`` rows, one after the other: ``pieces`` are the
    graphs' batch sizes, largest first; the rows run out in the last piece, which is padded
    when its graph is larger than the rows left for it."""

    batch: int
    pieces: tuple[int, ...]
    cost_ms: float
    """The sum of the pieces' measured replay times."""

    @property
    def chunks(self) -> list[tuple[int, int, int]]:
        """``(start, stop, graph batch)`` of each piece, in row order."""
        spans, start = [], 0
        for size in self.pieces:
            stop = min(start + size, self.batch)
            spans.append((start, stop, size))
            start = stop
        return spans

    def __str__(self) -> str:
        if len(self.pieces) == 1:
            size = self.pieces[0]
            return "graph" if size == self.batch else f"padded to {size}"
        return "chunks " + "+".join(map(str, self.pieces))


def cheapest_route(batch: int, graph_ms: Mapping[int, float]) -> Route | None:
    """The fastest way to serve ``batch`` rows with graphs whose replays take ``graph_ms``
    (milliseconds by the graph's batch size), padding at most the last piece; ``None`` if no
    graph is given.

    Exact over the sizes given (dynamic programming over the rows left): a batch of 13 with
    graphs of 16 (4.0 ms), 8 (2.2 ms) and 4 (1.5 ms) goes to the 16, padded (4.0 ms), rather
    than to 8+8 (4.4 ms) or 8+4+4 (5.2 ms). Among equally cheap routes the one with fewer
    pieces wins. Takes ``batch`` times the number of sizes steps: the runner keeps the answer
    until its graphs change.
    """
    sizes = sorted(graph_ms)
    if not sizes:
        return None
    best: list[tuple[float, int, tuple[int, ...]]] = [(0.0, 0, ())]
    for rows in range(1, batch + 1):
        options = []
        for size in sizes:
            cost, count, pieces = best[max(0, rows - size)]
            options.append((cost + graph_ms[size], count + 1, (size, *pieces)))
        best.append(min(options))
    cost, _, pieces = best[batch]
    return Route(batch, tuple(sorted(pieces, reverse=True)), cost)


@dataclass(frozen=True, slots=True)
class FusionChoice:
    """Which graph one key keeps: with its layers compiled (``compiled``) or as the adapter
    built them (hand-written fusions included), and why."""

    compiled: bool
    reason: str
    plain_ms: float | None = None
    """The replay of the graph as built, where both were measured."""
    compiled_ms: float | None = None
    """The replay of the graph with compiled layers, where both were measured."""

    def __str__(self) -> str:
        kept = "compiled layers" if self.compiled else "layers as built"
        return f"{kept}: {self.reason}"


def fusion_choice(plain_ms: float, compiled_ms: float) -> FusionChoice:
    """The choice between a key's two graphs measured at ``plain_ms`` and ``compiled_ms``:
    the compiled one where it is under :data:`FUSION_MARGIN` of the other."""
    measured = f"{compiled_ms:.3f} ms compiled against {plain_ms:.3f} ms as built"
    if compiled_ms < FUSION_MARGIN * plain_ms:
        return FusionChoice(True, measured, plain_ms, compiled_ms)
    return FusionChoice(False, f"{measured}, not faster", plain_ms, compiled_ms)
