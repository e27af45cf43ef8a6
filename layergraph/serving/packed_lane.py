"""The packed lane: which token budget's graph serves a packed call.

For plans whose calls pack many images of different sizes into one sequence
(:attr:`~layergraph.adapter.CapturePlan.packing`). With ``batch_sizes="auto"`` the budgets are
learnt from the traffic (:class:`~layergraph.serving.budgets.BudgetPlanner`): the first calls run
eagerly while the planner observes their token totals, each timed; a fresh pool's first call
then captures every budget of the plan, largest first; a call without a graph of its own
budget goes to the cheapest larger budget held when measured faster than eager. A call above
every budget is split by images. With budgets given, a call takes the smallest that holds it.

What this module does not do: capture, replay or measure (the engine does), or read a call
(the plan's :class:`~layergraph.packing.Packing` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..keys import BatchBuckets, ShapeKey
from ..packing import PackedCall, Packing
from ..progress import track
from .budgets import OBSERVED_PER_BUDGET, BudgetPlanner
from .engine import GraphEngine

__all__ = ["PackedLane", "check_budgets"]

OBSERVING = "observing the traffic before choosing token budgets"
"""Why a packed plan's first calls run eagerly
(:class:`~layergraph.serving.budgets.BudgetPlanner`)."""

_NEAR = 1.25
"""An eager call observed with at least ``1 / _NEAR`` and at most ``_NEAR`` times a call's
tokens stands for that call's eager time when a graph serving it is measured."""


class PackedLane:
    """Serves packed calls from graphs keyed by token budget (see the module's text)."""

    def __init__(self, engine: GraphEngine, packing: Packing[PackedCall]) -> None:
        self.engine = engine
        self.packing = packing
        self.options = engine.options
        self.buckets = BatchBuckets(None if self.options.measured else self.options.batch_sizes)
        check_budgets(self.buckets.sizes or (), packing.budget_unit)
        self._planner: BudgetPlanner | None = None
        """The learnt token budgets (``batch_sizes="auto"``)."""
        if self.options.measured:
            observed = self.options.observe_calls
            self._planner = BudgetPlanner(
                packing.budget_step,
                packing.largest_budget,
                engine.max_graphs,
                OBSERVED_PER_BUDGET * engine.max_graphs if observed is None else observed,
            )
        self._planned = 0
        """The planner's generation whose budgets the graphs held follow."""
        self._pools_planned = 0
        """The planner's count of tops whose pool the graphs held share."""
        self._observed_ms: dict[Any, list[tuple[int, float]]] = {}
        """The eager calls timed while the planner observed, by call signature: (tokens,
        milliseconds) each."""
        engine.eager_stand_in = self._observed_eager_ms

    @property
    def budgets(self) -> tuple[int, ...]:
        """The learnt token budgets, or none while observing or with budgets given."""
        return self._planner.budgets if self._planner is not None else ()

    def token_totals(self) -> tuple[tuple[int, int], ...]:
        """The calls the learnt budgets were chosen from, by token total (for a warm start);
        none with budgets given."""
        return tuple(sorted(self._planner.totals.items())) if self._planner is not None else ()

    def start_from(self, totals: Sequence[tuple[int, int]], budgets: Sequence[int]) -> None:
        """Start the learnt budgets from another process's: its plan ``budgets`` and the calls
        ``totals`` it chose them from (:meth:`token_totals`), instead of observing calls
        first (:meth:`~layergraph.serving.budgets.BudgetPlanner.start_from`); nothing with budgets
        given."""
        if self._planner is not None:
            self._planner.start_from(dict(totals), budgets)

    def forget(self) -> None:
        """The model changed under the graphs: its eager times observed no longer hold."""
        self._observed_ms.clear()

    def serve(self, call: PackedCall, fresh: bool) -> Any:
        """Serve a packed call from its budget's graph, captured if admitted; with learnt
        budgets, else from the cheapest larger budget held if measured faster than eager by
        :data:`~layergraph.serving.policy.ROUTE_MARGIN`; a call above every budget split by images;
        else eagerly, the reason counted. A budget's eager time is measured on its first eager
        call.

        With learnt budgets, the planner's first calls run eagerly while it observes them; a
        fresh pool's first call captures every budget of the plan, largest first
        (:meth:`_capture_ahead`), and a graph captured that way is measured on the first call
        it serves."""
        engine = self.engine
        planner = self._planner
        if planner is not None and planner.observing and call.size <= planner.largest:
            planner.observe(call.size)
            return self._observe_eagerly(call)
        budget = self._budget_for(call.size)
        if budget is None:
            return self._serve_split(call)
        if planner is not None and not len(engine.held):
            self._capture_ahead(call, budget)
        entry, reason = engine.entry_for(budget, call)
        if entry is not None and entry.costs is None:
            entry, reason = engine.settle(entry, call)
        if entry is not None:
            return engine.replay(entry, call, fresh, count=True)
        if not self.options.measured:
            return self._eager(reason, call)
        held = [
            entry
            for size, entry in engine.held.held_with(call.signature).items()
            if size >= call.size and entry.costs is not None and entry.costs.graph_pays
        ]
        if not held:
            return self._eager(reason, call)
        cheapest = min(held, key=lambda entry: entry.costs.graph_ms)
        other = f"the larger budgets held ({cheapest.key.batch} tokens)"
        pays, output = engine.other_way_pays(call, budget, reason, cheapest.costs.graph_ms, other)
        if not pays:
            return output
        entry = engine.held.get((cheapest.key.batch, call.signature))
        return engine.replay(entry, call, fresh, count=True)

    def _eager(self, reason: str, call: PackedCall) -> Any:
        return self.engine.run_eagerly(reason, call.args, call.kwargs, size=call.size)

    def _budget_for(self, size: int) -> int | None:
        """The token budget whose graph serves a call of ``size`` tokens, or ``None`` if the
        call is above every budget: learnt from the traffic (the graphs of budgets a new plan
        leaves out dropped), the user's budgets, or the call's own size (``None``)."""
        if self._planner is None:
            return self.buckets.bucket_for(size)
        engine = self.engine
        budget = self._planner.budget_for(size)
        if self._planner.generation != self._planned:
            self._planned = self._planner.generation
            engine.stats.replans += 1
            if self._planner.pools != self._pools_planned:
                self._pools_planned = self._planner.pools
                engine.forget("graphs")
            else:
                engine.keep_budgets(self._planner.budgets)
        return budget

    def _observe_eagerly(self, call: PackedCall) -> Any:
        """Serve a call the planner observes eagerly, timed (waited for, as the measurements
        of a capture are): a graph serving calls of about its size later is measured against
        this time instead of an eager call of its own (:meth:`_observed_eager_ms`)."""
        output, eager_ms = self.engine.time_eagerly(OBSERVING, call)
        self._observed_ms.setdefault(call.signature, []).append((call.size, eager_ms))
        return output

    def _observed_eager_ms(self, call: PackedCall) -> float | None:
        """The fastest eager call observed with ``call``'s signature and about its tokens
        (within :data:`_NEAR`), or ``None`` if none was."""
        times = [
            ms
            for size, ms in self._observed_ms.get(call.signature, ())
            if call.size / _NEAR <= size <= call.size * _NEAR
        ]
        return min(times, default=None)

    def _capture_ahead(self, call: PackedCall, budget: int) -> None:
        """In a fresh pool, capture every budget of the plan for ``call``'s signature, largest
        first, so that each capture takes blocks the larger ones freed instead of growing the
        pool. A budget below ``budget`` (``call``'s own) is captured from the call's first
        piece that fits it (:meth:`~layergraph.packing.Packing.split`), or left to its first
        call if its first image does not. Each graph is measured later, on the first call it
        serves (:meth:`~layergraph.serving.engine.GraphEngine.settle`): the call's own budget right
        after. A budget not measured faster than eager or whose capture failed is skipped, and a
        capture that fails ends the loop; nothing is captured while ``capture_after`` holds the
        call's own budget back, or without lazy capture."""
        engine = self.engine
        own = (budget, call.signature)
        if not self.options.lazy or engine.held.sightings(own) + 1 < self.options.capture_after:
            return
        engine.plan.check_inputs(call)
        for planned in sorted(self._planner.budgets, reverse=True):
            lookup = (planned, call.signature)
            costs = engine.held.costs(lookup)
            if engine.held.failure(lookup) is not None:
                continue
            if costs is not None and costs.graph_ms is not None and not costs.graph_pays:
                continue
            pieces = [call] if planned >= call.size else self.packing.split(call, planned)
            example = pieces[0]
            if example.size > planned or example.signature != call.signature:
                continue
            entry, _ = engine.capture(planned, example, measure=False)
            if entry is None:
                return

    def capture(
        self, call: PackedCall, budgets: Sequence[int] | None, progress: bool
    ) -> list[ShapeKey]:
        """Capture the graphs of ``budgets`` now (default: the budgets given to ``wrap``, or
        those learnt so far, or the smallest learnt budget that holds ``call``), largest
        first, each from ``call`` or its first piece that fits (the images of ``call`` that
        fit, :meth:`~layergraph.packing.Packing.split`), each measured against eager. A budget
        none of whose pieces fit is left out; a graph not measured faster than eager is not kept.
        Returns the keys held. Called under the engine's lock.

        Learnt budgets are still chosen from the traffic observed first: a graph of a budget
        the plan then leaves out is dropped.
        """
        engine = self.engine
        engine.plan.check_inputs(call)
        planned = self._planner.budgets if self._planner is not None else ()
        if budgets is None:
            step = self.packing.budget_step
            budgets = self.buckets.sizes or planned or (-(-call.size // step) * step,)
        check_budgets(budgets, self.packing.budget_unit)
        largest_first = sorted(set(budgets), reverse=True)
        keys = []
        for budget in track(largest_first, "capturing graphs", enabled=progress):
            example = call if budget >= call.size else self.packing.split(call, budget)[0]
            if example.size > budget or example.signature != call.signature:
                continue
            entry = engine.capture_ahead(budget, example, len(largest_first))
            if entry is not None:
                keys.append(entry.key)
        return keys

    def _serve_split(self, call: PackedCall) -> Any:
        """A packed call above every budget, split by images into calls that fit, each served
        on its own, and an image above every budget run eagerly apart (the reason counted);
        a call of that one image alone runs eagerly."""
        engine = self.engine
        largest = self.packing.largest_budget if self.options.measured else self.buckets.largest
        reason = f"an image of this call is above the largest token budget ({largest})"
        pieces = self.packing.split(call, largest) if largest is not None else [call]
        if len(pieces) == 1:
            return self._eager(reason, call)
        parts, eager = [], 0
        for piece in pieces:
            if piece.size > largest:
                eager += 1
                parts.append(
                    engine.run_eagerly(
                        f"{reason}: it ran eagerly, the rest from graphs", piece.args, piece.kwargs
                    )
                )
            else:
                parts.append(self.serve(piece, fresh=True))
        engine.stats.split_calls += 1
        way = f"split into {len(pieces)} calls" + (f", {eager} eager" if eager else "")
        engine.stats.served[(call.size, way)] += 1
        return self.packing.join(parts)


def check_budgets(budgets: Sequence[int], unit: int) -> None:
    """Raise ``ValueError`` unless every token budget given is a multiple of the packing's
    ``unit`` (a graph of another budget would pad a real token's group)."""
    bad = [budget for budget in budgets if budget % unit]
    if bad:
        raise ValueError(
            f"token budgets {bad} are not multiples of {unit} tokens, which this model's calls "
            f"come in (batch_sizes of a packed model are token budgets)"
        )
