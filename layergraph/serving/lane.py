"""The protocol of a lane: which graph serves a call, over one graph engine.

Two lanes implement it: batches (:class:`~layergraph.serving.batched_lane.BatchedLane`) and
token budgets (:class:`~layergraph.serving.packed_lane.PackedLane`). The runner serves every
call through it and knows no lane's own rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..keys import ShapeKey

__all__ = ["Lane"]


class Lane(Protocol):
    """Which graph serves a call, over one :class:`GraphEngine`: batches
    (:class:`~layergraph.serving.batched_lane.BatchedLane`) or token budgets
    (:class:`~layergraph.serving.packed_lane.PackedLane`). Called under the engine's lock."""

    @property
    def budgets(self) -> tuple[int, ...]:
        """The learnt token budgets (none for batches, or while observing)."""
        ...

    def serve(self, call: Any, fresh: bool) -> Any:
        """Serve ``call`` from a graph, or eagerly with the reason counted."""
        ...

    def capture(self, call: Any, sizes: Sequence[int] | None, progress: bool) -> list[ShapeKey]:
        """Capture the graphs of ``sizes`` (batch sizes or token budgets) now from ``call``,
        largest first; the keys held."""
        ...

    def forget(self) -> None:
        """The model changed under the graphs: forget what the lane knew of it."""
        ...

    def token_totals(self) -> tuple[tuple[int, int], ...]:
        """The calls learnt budgets were chosen from, by token total (for a warm start)."""
        ...

    def start_from(self, totals: Sequence[tuple[int, int]], budgets: Sequence[int]) -> None:
        """Start learnt budgets from another process's (a warm start)."""
        ...
