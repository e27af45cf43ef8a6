"""The graph runner: one CUDA graph per shape key, a shared pool, padding and eager fallback."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from .adapter import CapturePlan
from .budgets import OBSERVED_PER_BUDGET, PACKED_MAX_GRAPHS, BudgetPlanner
from .cache import GraphCache, GraphEntry
from .graphs import GraphBackend, GraphCaptureError
from .guards import GLOBAL_HOOKS, HookFingerprint, HookWatch, ParameterWatch, addresses
from .keys import BatchBuckets, CallInputs, ShapeKey, UnsupportedCall
from .packing import PackedCall
from .policy import ROUTE_MARGIN, Costs, Route, cheapest_route
from .progress import track
from .stats import GraphStats
from .validation import GraphMismatchError, compare_outputs
from .warn import warn

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "CaptureFailedWarning",
    "GraphRunner",
    "RunnerOptions",
    "StaleOutputWarning",
]

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""A common choice of fixed buckets (``batch_sizes=DEFAULT_BATCH_SIZES``): powers of two."""

DEFAULT_MAX_GRAPHS = 32
"""The default ``max_graphs`` of a plan keyed by batch size (packed plans:
:data:`~layergraph.budgets.PACKED_MAX_GRAPHS`)."""

_MEASURED_RUNS = 3
"""Eager calls and replays timed at each capture; the fastest of each is kept."""

_DECISIVE = 1.5
"""A packed graph's capture times one eager call, and more (up to :data:`_MEASURED_RUNS`) only
while the fastest replay is not this many times faster than the fastest eager call: further
eager calls could only come out faster than a first one slowed by half, which is rare."""

_OBSERVING = "observing the traffic before choosing token budgets"
"""Why a packed plan's first calls run eagerly (:class:`~layergraph.budgets.BudgetPlanner`)."""

_NEAR = 1.25
"""An eager call observed with at least ``1 / _NEAR`` and at most ``_NEAR`` times a call's
tokens stands for that call's eager time when a graph serving it is measured."""


class StaleOutputWarning(UserWarning):
    """A replay overwrote outputs of an earlier replay that the caller still held."""


class CaptureFailedWarning(UserWarning):
    """A shape's capture failed though its eager runs did not (an operator a CUDA stream capture
    refuses, a host read, a synchronisation): its calls run eagerly. Warned once per failure."""


@dataclass(frozen=True)
class RunnerOptions:
    """How a runner captures and serves graphs; the keyword options of :func:`layergraph.wrap`.

    - ``batch_sizes``: ``"auto"`` (the default): each batch size that comes gets a graph of its
      own, kept only if measured faster than eager; a batch without one is served by the
      cheapest combination of graphs held (padded, or in chunks) when measured faster than
      eager, else eagerly (:mod:`layergraph.policy`). A sequence of sizes: fixed buckets, a
      smaller batch padded up to the next, a batch larger than all split into chunks of the
      largest. ``None``: one graph per exact batch size, no padding, no splitting. In every
      mode a graph measured slower than an eager call of its own batch is dropped at capture,
      and its calls run eagerly.
    - ``lazy``: capture a key the first time a call needs it. Off: only keys captured through
      :meth:`GraphRunner.capture` replay; other calls run eagerly.
    - ``max_graphs``: no more graphs than this; once all are held, a new key displaces the
      least used graph only after it was seen more often than that graph was used, and runs
      eagerly until then (:class:`~layergraph.cache.GraphCache`). ``None`` (the default): 32,
      or 8 for a packed plan, whose learnt token budgets are chosen to make do with that many
      (:mod:`layergraph.budgets`).
    - ``capture_after``: capture a key only once calls have needed it this many times (the
      calls before run eagerly), so that rare shapes do not take graph memory.
    - ``static_output``: return views of the graph's own output buffers (no copy). They are
      overwritten by the next replay of the same key, which warns if an earlier output is still
      referenced; by default each call returns fresh tensors.
    - ``validate``: compare the first replay of each key with eager on the same input and raise
      :class:`~layergraph.validation.GraphMismatchError` beyond ``tolerance`` (relative error;
      ``None`` takes the per-dtype default); and raise the error of a capture that fails
      though its warm-up runs did not, where by default its key runs eagerly with a
      :class:`CaptureFailedWarning`.
    - ``warmup_runs``: eager runs on a side stream before each capture.
    - ``debug``: check at every replay that each buffer the graph uses (static inputs and
      outputs, per-key state, the model's parameters) still has its captured address.
    - ``observe_calls``: a packed plan with learnt budgets serves this many first calls
      eagerly, observing their token totals, before it chooses budgets
      (:mod:`layergraph.budgets`); ``None`` (the default): four times ``max_graphs``. Other plans
      ignore it.
    """

    batch_sizes: Sequence[int] | Literal["auto"] | None = "auto"
    lazy: bool = True
    max_graphs: int | None = None
    capture_after: int = 1
    static_output: bool = False
    validate: bool = False
    tolerance: float | None = None
    warmup_runs: int = 2
    debug: bool = False
    observe_calls: int | None = None

    def __post_init__(self) -> None:
        if self.max_graphs is not None and self.max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {self.max_graphs}")
        if self.warmup_runs < 1:
            raise ValueError(f"warmup_runs must be at least 1, got {self.warmup_runs}")
        if self.observe_calls is not None and self.observe_calls < 0:
            raise ValueError(f"observe_calls must be at least 0, got {self.observe_calls}")
        if self.capture_after < 1:
            raise ValueError(f"capture_after must be at least 1, got {self.capture_after}")
        if isinstance(self.batch_sizes, str) and self.batch_sizes != "auto":
            raise ValueError(
                f"batch_sizes must be 'auto', None or a sequence of sizes, got {self.batch_sizes!r}"
            )

    @property
    def measured(self) -> bool:
        """Whether batch sizes are served the way measured fastest (``batch_sizes="auto"``)."""
        return self.batch_sizes == "auto"


class GraphRunner:
    """Serves calls of one capture plan from CUDA graphs, one per shape key.

    Workflow of a call: the arguments are split into batched tensors and the rest
    (:class:`~layergraph.keys.CallInputs`); anything a graph cannot serve (no CUDA, training
    mode, gradients, another device or dtype, unsupported arguments) runs the plan's region
    eagerly and is counted with its reason. Otherwise the batch is mapped to its graph or
    graphs (its own, a bucket, chunks: ``batch_sizes``), the key's graph is found or captured,
    the inputs are copied into the graph's static buffers (padding rows zeroed), the graph is
    replayed on the caller's stream, and the padding rows are sliced off the outputs, which are
    cloned unless ``static_output`` is set.

    Each capture measures the graph's replay against an eager call of the same batch
    (:class:`~layergraph.policy.Costs`); a graph slower than eager is dropped and its batch
    runs eagerly from then on. With ``batch_sizes="auto"`` those measurements also choose how
    a batch without a graph of its own is served (:mod:`layergraph.policy`).

    All graphs share one memory pool. The runner does not know the model: the plan supplies the
    region and its checks. Before each call it checks, cheaply, that the model's parameters and
    buffers still live where the graphs read them (:class:`~layergraph.guards.ParameterWatch`);
    if not, every graph is dropped and captured again on demand. A capture that runs out of
    device memory drops every graph and the pool, and its key runs eagerly from then on. A
    capture that fails otherwise, though the warm-up runs of the same inputs did not (an
    operator a CUDA stream capture refuses), leaves the other graphs and the pool, and its key
    runs eagerly from then on with a :class:`CaptureFailedWarning` (``validate`` raises the
    error instead); an error of the warm-up runs is the model's, and raised.

    A replay runs the captured kernels, never Python, so forward hooks only run in eager calls.
    Graphs are captured with the hooks of ``hooks``, a baseline (default: the forward hooks on
    the plan's owner, its submodules and PyTorch's global ones when the runner is made); while
    the hooks differ from it (:class:`~layergraph.guards.HookWatch`), calls run eagerly, so
    that added hooks run and removed ones do not. :meth:`accept_current_hooks` re-arms it.
    Hooks the model registers on itself while the runner runs it (eagerly or to capture) join
    the baseline: transformers installs its output-capturing hooks that way on first use.

    Outputs that are not one row per input (a loss averaged over the batch, a 0-d tensor) are
    found at capture; calls that would pad or split such a key run eagerly.

    Thread safety: calls are served one at a time (a lock), since replays share static buffers;
    a call on another CUDA stream waits, through an event, for the previous call's work.
    """

    def __init__(
        self,
        plan: CapturePlan,
        options: RunnerOptions,
        backend: GraphBackend,
        captured_region: Callable[..., Any] | None = None,
        hooks: HookFingerprint | None = None,
        capture_contexts: Callable[[], Sequence[AbstractContextManager[Any]]] | None = None,
    ) -> None:
        self.plan = plan
        self._captured_region = captured_region or plan.region
        """What warm-up and capture run: the plan's region, or a compiled version of it."""
        self._capture_contexts = capture_contexts or tuple
        """The contexts plugins enter around each warm-up and capture
        (:func:`~layergraph.hookspecs.capture_context`)."""
        self.options = options
        self.backend = backend
        self.buckets = BatchBuckets(None if options.measured else options.batch_sizes)
        if plan.packing is not None:
            _check_budgets(self.buckets.sizes or (), plan.packing.budget_unit)
        self._routes: dict[Any, tuple[int, Route | None]] = {}
        """The cheapest route over the graphs held, by lookup, with the cache's generation it
        was chosen in (:func:`~layergraph.policy.cheapest_route`)."""
        self.max_graphs = options.max_graphs or (
            PACKED_MAX_GRAPHS if plan.packing is not None else DEFAULT_MAX_GRAPHS
        )
        """The most graphs held at once (``max_graphs``, or its default for the plan)."""
        self._planner: BudgetPlanner | None = None
        """A packed plan's learnt token budgets (``batch_sizes="auto"``)."""
        self._planned = 0
        """The planner's generation whose budgets the graphs held follow."""
        self._pools_planned = 0
        """The planner's count of tops whose pool the graphs held share."""
        self._warmed: set[Any] = set()
        """Call signatures of a packed plan captured since the model last changed: the lazy
        initialisation of their kernels has run, so their next captures warm up once."""
        self._observed_ms: dict[Any, list[tuple[int, float]]] = {}
        """The eager calls timed while the planner observed, by call signature: (tokens,
        milliseconds) each."""
        if plan.packing is not None and options.measured:
            packing = plan.packing
            observed = options.observe_calls
            self._planner = BudgetPlanner(
                packing.budget_step,
                packing.largest_budget,
                self.max_graphs,
                OBSERVED_PER_BUDGET * self.max_graphs if observed is None else observed,
            )
        self._entries = GraphCache(self.max_graphs, options.capture_after)
        """Every graph, and everything known about each key: its graph with that graph's
        validation, its sightings, or its failed capture."""
        self._done: Any = None
        self._stats = GraphStats()
        self._pool: Any = None
        self._lock = threading.RLock()
        self._unavailable = backend.unavailable_reason()
        self._watch = ParameterWatch(plan.owner)
        self._hooks = HookWatch(plan.owner, hooks)
        """The forward hooks graphs are captured with, and whether the model's differ now."""
        self._refresh_parameters()

    def _refresh_parameters(self) -> None:
        self._parameters = tuple(self.plan.owner.parameters())
        self._reference = self._parameters[0] if self._parameters else None

    # ---- calls -------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan.packing is not None:
            return self._call_packed(args, kwargs)
        try:
            call = CallInputs(args, kwargs)
        except UnsupportedCall as unsupported:
            return self._run_eagerly(str(unsupported), args, kwargs, explain_errors=True)
        if call.batch == 0:
            raise ValueError(
                f"empty batch: the tensor arguments have 0 rows "
                f"({', '.join(str(tuple(t.shape)) for t in call.tensors)})"
            )
        with self._lock:
            if self._watch.changed():
                self._forget_everything()
                self._refresh_parameters()
            reason = self._eager_reason(call)
            if reason is None:
                return self._serve(call, args, kwargs, fresh=False)
        explain = reason.startswith("input ")  # the model would fail on such inputs
        return self._run_eagerly(reason, args, kwargs, explain_errors=explain, batch=call.batch)

    def _forget_everything(self) -> None:
        """The model changed under the graphs (parameters moved, hooks accepted): drop every
        graph, sightings and failures, counting an invalidation if any graph was held."""
        if len(self._entries):
            self._stats.invalidations += 1
        self._entries.clear()
        self._warmed.clear()
        self._observed_ms.clear()
        self._pool = None

    def _drop_graphs(self) -> None:
        """Drop every graph and the pool; the next capture starts a new pool."""
        self._entries.drop_graphs()
        self._pool = None

    def _serve(
        self, call: CallInputs, args: tuple[Any, ...], kwargs: dict[str, Any], fresh: bool
    ) -> Any:
        """Serve one call from its bucket's graph; ``fresh`` forces cloned outputs."""
        if self.options.measured:
            return self._serve_measured(call, args, kwargs, fresh)
        bucket = self.buckets.bucket_for(call.batch)
        if bucket != call.batch and not self.plan.batch_independent:
            reason = f"batch {call.batch} needs padding or splitting, which this model forbids"
            return self._run_eagerly(reason, args, kwargs, batch=call.batch)
        if bucket is None:
            largest = self.buckets.largest
            entry, reason = self._entry_for(largest, call.sliced(0, largest))
        else:
            entry, reason = self._entry_for(bucket, call)
        if entry is None:
            return self._run_eagerly(reason, args, kwargs, batch=call.batch)
        if bucket != call.batch and entry.not_per_row is not None:
            reason = _not_per_row_reason(entry.not_per_row, call.batch, split=bucket is None)
            return self._run_eagerly(reason, args, kwargs, batch=call.batch)
        if bucket is None:
            spans = self.buckets.chunks(call.batch)
            buckets = [self.buckets.bucket_for(stop - start) for start, stop in spans]
            described = "chunks " + "+".join(map(str, buckets))
            return self._serve_chunks(call, args, kwargs, spans, described)
        return self._replay(entry, call, fresh, count=True)

    def _serve_measured(
        self, call: CallInputs, args: tuple[Any, ...], kwargs: dict[str, Any], fresh: bool
    ) -> Any:
        """Serve one call the way measured fastest (``batch_sizes="auto"``): its own graph,
        captured if admitted; else the cheapest route over the graphs held, if measured faster
        than eager; else eagerly. A batch's eager time is measured on its first eager call."""
        entry, reason = self._entry_for(call.batch, call)
        if entry is not None:
            return self._replay(entry, call, fresh, count=True)
        route = self._held_route(call)
        if route is None:
            return self._run_eagerly(reason, args, kwargs, batch=call.batch)
        lookup = (call.batch, call.signature)
        costs = self._entries.costs(lookup)
        if costs is None:
            self._count_eager(reason, call.batch)
            with self._hooks.adopting():
                output, eager_ms = self.backend.time_eager(
                    lambda: self.plan.region(*args, **kwargs), call.batch
                )
            self._entries.measured(lookup, Costs(eager_ms))
            return output
        if route.cost_ms >= costs.eager_ms * ROUTE_MARGIN:
            reason = f"{reason}; the graphs held ({route}) were not measured faster than eager"
            return self._run_eagerly(reason, args, kwargs, batch=call.batch)
        if len(route.pieces) == 1:
            entry = self._entries.get((route.pieces[0], call.signature))
            return self._replay(entry, call, fresh, count=True)
        spans = [(start, stop) for start, stop, _ in route.chunks]
        return self._serve_chunks(call, args, kwargs, spans, str(route), sizes=route.pieces)

    def _held_route(self, call: CallInputs) -> Route | None:
        """The cheapest way to serve ``call`` with the graphs held for its signature (padded,
        or in chunks), or ``None`` if none may; chosen again whenever the graphs change."""
        if not self.plan.batch_independent:
            return None
        lookup = (call.batch, call.signature)
        generation = self._entries.generation
        chosen = self._routes.get(lookup)
        if chosen is not None and chosen[0] == generation:
            return chosen[1]
        graph_ms = {
            batch: entry.costs.graph_ms
            for batch, entry in self._entries.held_with(call.signature).items()
            if entry.not_per_row is None
            and entry.costs is not None
            and entry.costs.graph_ms is not None
        }
        route = cheapest_route(call.batch, graph_ms)
        if len(self._routes) >= 4 * self.max_graphs + 64:
            self._routes.clear()
        self._routes[lookup] = (generation, route)
        return route

    def _serve_chunks(
        self,
        call: CallInputs,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        spans: Sequence[tuple[int, int]],
        described: str,
        sizes: Sequence[int] | None = None,
    ) -> Any:
        """Rows ``spans`` of the call, each served by a graph (of ``sizes``, in order, or its
        bucket's) and its output cloned before the next replays; the outputs joined.

        Outputs the chunks cannot be joined by (not one row per input in some chunk's graph)
        send the whole call to eager instead.
        """
        chunks = [call.sliced(start, stop) for start, stop in spans]
        if sizes is None:
            parts = [
                self._serve(chunk, *chunk.rebuild(chunk.tensors), fresh=True) for chunk in chunks
            ]
        else:
            parts = []
            for chunk, size in zip(chunks, sizes):
                entry = self._entries.get((size, chunk.signature))
                parts.append(self._replay(entry, chunk, fresh=True))
        try:
            joined = _concatenate(parts, [chunk.batch for chunk in chunks])
        except _NotPerRow as problem:
            reason = _not_per_row_reason(str(problem), call.batch, split=True)
            return self._run_eagerly(reason, args, kwargs, batch=call.batch)
        self._stats.split_calls += 1
        self._stats.served[(call.batch, described)] += 1
        return joined

    # ---- packed plans: token budgets ----------------------------------------------------------

    def _call_packed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a packed plan: read on the host by the plan's packing, then served as
        :meth:`_serve_packed` says, or eagerly."""
        try:
            call = self.plan.packing.pack(args, kwargs)
        except UnsupportedCall as unsupported:
            return self._run_eagerly(str(unsupported), args, kwargs, explain_errors=True)
        with self._lock:
            if self._watch.changed():
                self._forget_everything()
                self._refresh_parameters()
            reason = self._eager_reason(call)
            if reason is None:
                return self._serve_packed(call, fresh=False)
        return self._run_eagerly(reason, args, kwargs, batch=call.size)

    def _budget_for(self, size: int) -> int | None:
        """The token budget whose graph serves a call of ``size`` tokens, or ``None`` if the
        call is above every budget: learnt from the traffic (``batch_sizes="auto"``,
        :class:`~layergraph.budgets.BudgetPlanner`, the graphs of budgets a new plan leaves
        out dropped), the user's budgets, or the call's own size (``None``)."""
        if self._planner is None:
            return self.buckets.bucket_for(size)
        budget = self._planner.budget_for(size)
        if self._planner.generation != self._planned:
            self._planned = self._planner.generation
            self._stats.replans += 1
            if self._planner.pools != self._pools_planned:
                self._pools_planned = self._planner.pools
                self._drop_graphs()
            elif self._entries.keep_buckets(self._planner.budgets) and not len(self._entries):
                self._pool = None
        return budget

    def _serve_packed(self, call: PackedCall, fresh: bool) -> Any:
        """Serve a packed call from its budget's graph, captured if admitted; with learnt
        budgets, else from the cheapest larger budget held if measured faster than eager by
        :data:`~layergraph.policy.ROUTE_MARGIN`; a call above every budget split by images;
        else eagerly, the reason counted. A budget's eager time is measured on its first eager
        call.

        With learnt budgets, the planner's first calls run eagerly while it observes them; a
        fresh pool's first call captures every budget of the plan, largest first
        (:meth:`_capture_ahead`), and a graph captured that way is measured on the first call
        it serves."""
        planner = self._planner
        if planner is not None and planner.observing and call.size <= planner.largest:
            planner.observe(call.size)
            return self._observe_eagerly(call)
        budget = self._budget_for(call.size)
        if budget is None:
            return self._serve_split(call)
        if planner is not None and not len(self._entries):
            self._capture_ahead(call, budget)
        entry, reason = self._entry_for(budget, call)
        if entry is not None and entry.costs is None:
            entry, reason = self._measure_later(entry, call)
        if entry is not None or not self.options.measured:
            if entry is None:
                return self._run_eagerly(reason, call.args, call.kwargs, batch=call.size)
            return self._replay(entry, call, fresh, count=True)
        lookup = (budget, call.signature)
        held = [
            entry
            for size, entry in self._entries.held_with(call.signature).items()
            if size >= call.size and entry.costs is not None and entry.costs.graph_pays
        ]
        if not held:
            return self._run_eagerly(reason, call.args, call.kwargs, batch=call.size)
        costs = self._entries.costs(lookup)
        if costs is None:
            self._count_eager(reason, call.size)
            with self._hooks.adopting():
                output, eager_ms = self.backend.time_eager(
                    lambda: self.plan.region(*call.args, **call.kwargs), call.size
                )
            self._entries.measured(lookup, Costs(eager_ms))
            return output
        cheapest = min(held, key=lambda entry: entry.costs.graph_ms)
        if cheapest.costs.graph_ms >= costs.eager_ms * ROUTE_MARGIN:
            reason = (
                f"{reason}; the larger budgets held ({cheapest.key.batch} tokens) were not "
                f"measured faster than eager"
            )
            return self._run_eagerly(reason, call.args, call.kwargs, batch=call.size)
        entry = self._entries.get((cheapest.key.batch, call.signature))
        return self._replay(entry, call, fresh, count=True)

    def _observe_eagerly(self, call: PackedCall) -> Any:
        """Serve a call the planner observes eagerly, timed (waited for, as the measurements
        of a capture are): a graph serving calls of about its size later is measured against
        this time instead of an eager call of its own (:meth:`_observed_eager_ms`)."""
        self._count_eager(_OBSERVING, call.size)
        with self._hooks.adopting():
            output, eager_ms = self.backend.time_eager(
                lambda: self.plan.region(*call.args, **call.kwargs), call.size
            )
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
        serves (:meth:`_measure_later`): the call's own budget right after. A budget measured
        slower than eager or whose capture failed is skipped, and a capture that fails ends
        the loop; nothing is captured while ``capture_after`` holds the call's own budget
        back, or without lazy capture."""
        own = (budget, call.signature)
        if not self.options.lazy or self._entries.sightings(own) + 1 < self.options.capture_after:
            return
        self.plan.check_inputs(call)
        packing = self.plan.packing
        for planned in sorted(self._planner.budgets, reverse=True):
            lookup = (planned, call.signature)
            costs = self._entries.costs(lookup)
            if self._entries.failure(lookup) is not None:
                continue
            if costs is not None and costs.graph_ms is not None and not costs.graph_pays:
                continue
            pieces = [call] if planned >= call.size else packing.split(call, planned)
            example = pieces[0]
            if example.size > planned or example.signature != call.signature:
                continue
            key = ShapeKey(planned, self.plan.sequence_of(example))
            entry, _ = self._capture(key, lookup, example, measure=False)
            if entry is None:
                return

    def _measure_later(self, entry: GraphEntry, call: PackedCall) -> tuple[GraphEntry | None, str]:
        """Measure a graph captured ahead of its calls (:meth:`_capture_ahead`) on ``call``, the
        first it serves; keep it if it pays, else drop it (its costs kept)."""
        lookup = (entry.key.batch, call.signature)
        started = time.perf_counter()
        costs = self._measure_packed(entry.graph, entry.state, entry.output_leaves, call)
        self._stats.capture_seconds += time.perf_counter() - started
        kept = self._entries.settle(lookup, costs)
        if kept is not None:
            return kept, ""
        self._stats.slower_graphs += 1
        return None, f"the graph of batch {entry.key.batch} was measured slower than eager"

    def _serve_split(self, call: PackedCall) -> Any:
        """A packed call above every budget, split by images into calls that fit, each served
        on its own, and an image above every budget run eagerly apart (the reason counted);
        a call of that one image alone runs eagerly."""
        largest = (
            self.plan.packing.largest_budget if self.options.measured else self.buckets.largest
        )
        reason = f"an image of this call is above the largest token budget ({largest})"
        pieces = self.plan.packing.split(call, largest) if largest is not None else [call]
        if len(pieces) == 1:
            return self._run_eagerly(reason, call.args, call.kwargs, batch=call.size)
        parts, eager = [], 0
        for piece in pieces:
            if piece.size > largest:
                eager += 1
                parts.append(
                    self._run_eagerly(
                        f"{reason}: it ran eagerly, the rest from graphs",
                        piece.args,
                        piece.kwargs,
                    )
                )
            else:
                parts.append(self._serve_packed(piece, fresh=True))
        self._stats.split_calls += 1
        way = f"split into {len(pieces)} calls" + (f", {eager} eager" if eager else "")
        self._stats.served[(call.size, way)] += 1
        return self.plan.packing.join(parts)

    def _count_eager(self, reason: str, batch: int | None) -> None:
        self._stats.eager_calls[reason] += 1
        if batch is not None:
            self._stats.served[(batch, "eager")] += 1

    def _run_eagerly(
        self,
        reason: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        explain_errors: bool = False,
        batch: int | None = None,
    ) -> Any:
        """Run the region eagerly, counting ``reason`` (and ``batch``'s way, when known).

        With ``explain_errors``, an error raised by the model is re-raised as a ``ValueError``
        that names ``reason`` first (an input unlike the model's), the model's error chained.
        """
        self._count_eager(reason, batch)
        with self._hooks.adopting():
            if not explain_errors:
                return self.plan.region(*args, **kwargs)
            try:
                return self.plan.region(*args, **kwargs)
            except Exception as error:
                raise ValueError(
                    f"{reason}; the model raised {type(error).__name__}: {error}"
                ) from error

    def _eager_reason(self, call: CallInputs | PackedCall) -> str | None:
        """Why this call cannot be served by a graph, or ``None`` if it can."""
        if self._unavailable is not None:
            return self._unavailable
        if self.plan.owner.training:
            return "model is in training mode"
        places = self._hooks.differences()
        if places:
            return _hooks_reason(places, self.plan.owner)
        reference = self._reference
        device = reference.device if reference is not None else call.tensors[0].device
        if device.type != self.backend.device_type:
            return f"model is on {device}; graphs need a {self.backend.device_type} device"
        for tensor in call.tensors:
            if tensor.device != device:
                return f"input on {tensor.device}, model on {device}"
            if (
                reference is not None
                and tensor.is_floating_point()
                and reference.is_floating_point()
                and tensor.dtype != reference.dtype
            ):
                return f"input dtype {tensor.dtype} differs from model dtype {reference.dtype}"
        if torch.is_grad_enabled() and (
            any(t.requires_grad for t in call.tensors)
            or any(p.requires_grad for p in self._parameters)
        ):
            return "gradients are enabled (call under torch.inference_mode() or torch.no_grad())"
        if torch.is_autocast_enabled(self.backend.device_type):
            return "autocast is enabled"
        if self.backend.is_capturing():
            return "an enclosing graph capture is running"
        return self.plan.eager_reason(call)

    # ---- capture and replay -----------------------------------------------------------------

    def _entry_for(
        self, bucket: int, call: CallInputs | PackedCall
    ) -> tuple[GraphEntry | None, str]:
        lookup = (bucket, call.signature)
        entry = self._entries.get(lookup)
        if entry is not None:
            return entry, ""
        failure = self._entries.failure(lookup)
        if failure is not None:
            return None, failure
        costs = self._entries.costs(lookup)
        if costs is not None and costs.graph_ms is not None and not costs.graph_pays:
            return None, f"the graph of batch {bucket} was measured slower than eager"
        self.plan.check_inputs(call)
        key = ShapeKey(bucket, self.plan.sequence_of(call))
        if not self.options.lazy:
            return None, f"no graph captured for {key} and lazy capture is off"
        refusal = self._entries.admit(lookup)
        if refusal is not None:
            return None, refusal
        return self._capture(key, lookup, call)

    def _capture(
        self,
        key: ShapeKey,
        lookup: tuple[int, Any],
        call: CallInputs | PackedCall,
        measure: bool = True,
    ) -> tuple[GraphEntry | None, str]:
        """Capture ``key`` (measured unless ``measure`` is off); return its entry, or ``None``
        and why its call runs eagerly.

        A capture that runs out of memory drops every graph. One that fails otherwise after its
        warm-up runs, eager runs of the same inputs, succeeded (the backend's
        :class:`~layergraph.graphs.GraphCaptureError`) is recorded and warned about, or, with
        ``validate``, raises the capture's error. Any other error (the warm-up's: the model's
        own) is raised as it is.
        """
        try:
            entry = self._capture_entry(key, lookup, call, measure)
        except Exception as error:
            failed = error if isinstance(error, GraphCaptureError) else None
            cause = (error.__cause__ or error) if failed is not None else error
            # The failed capture's frames hold its half-built graph and the tensors of its
            # private pool; clear them, so that the error, held or dropped, keeps no memory.
            traceback.clear_frames(error.__traceback__)
            traceback.clear_frames(cause.__traceback__)
            if failed is None and not self.backend.is_out_of_memory(cause):
                raise
        else:
            if entry is None:
                return None, f"the graph of batch {key.batch} was measured slower than eager"
            return entry, ""
        if self.backend.is_out_of_memory(cause):
            return None, self._out_of_memory(key, lookup)
        if self.options.validate:
            raise cause
        return None, self._capture_failed(key, lookup, failed)

    def _out_of_memory(self, key: ShapeKey, lookup: tuple[int, Any]) -> str:
        """Drop every graph and the pool after ``key``'s capture ran out of memory, and record
        the failure; return the reason its calls run eagerly."""
        reason = f"capture of {key} ran out of device memory"
        self._drop_graphs()
        self.backend.release_memory()
        self._entries.fail(lookup, reason)
        self._stats.failed_captures += 1
        return reason

    def _capture_failed(
        self, key: ShapeKey, lookup: tuple[int, Any], failed: GraphCaptureError
    ) -> str:
        """Record that ``key`` cannot be captured, for the reason ``failed`` gives, and warn;
        return the reason its calls run eagerly. The other graphs and the pool stay."""
        reason = f"capture of {key} failed: {failed}"
        self._entries.fail(lookup, reason)
        self._stats.failed_captures += 1
        warn(
            f"{reason}; calls of this shape run eagerly until the model changes or the graphs "
            f"are released (graphed.stats counts them; validate=True raises the error instead)",
            CaptureFailedWarning,
        )
        return reason

    def _capture_entry(
        self,
        key: ShapeKey,
        lookup: tuple[int, Any],
        call: CallInputs | PackedCall,
        measure: bool = True,
    ) -> GraphEntry | None:
        """Capture and measure ``key``'s graph; store and return it, or, if it was measured
        slower than eager, record the costs and return ``None``. Without ``measure`` (a packed
        budget captured ahead of its calls) it is stored unmeasured, its costs ``None``.

        A packed call's buffers come from the plan's packing and are the graph's per-key state
        too; a batched call's static inputs are zeros of the key's batch, its state the plan's
        :meth:`~layergraph.adapter.CapturePlan.key_state`. The capture seconds counted include
        the buffers' allocation (where a plan times its attention backends) and the
        measurement."""
        started = time.perf_counter()
        if not len(self._entries):
            # A pool is shared only while one of its graphs lives: PyTorch's allocator refuses
            # to capture into a pool whose graphs were all released if any of its memory is
            # still held (an output kept by the caller, a cached cuBLAS workspace).
            self._pool = self.backend.new_pool()
        packing = self.plan.packing
        if isinstance(call, PackedCall):
            with torch.inference_mode(False):
                state = packing.allocate(key.batch, call)
            packing.load(state, call)
            static: tuple[torch.Tensor, ...] = ()
            args, kwargs = packing.arguments(state)
        else:
            with torch.inference_mode(False):
                static = tuple(
                    torch.zeros((key.batch, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    for t in call.tensors
                )
            _load(static, call.tensors)
            args, kwargs = call.rebuild(static)
        warmed = isinstance(call, PackedCall) and call.signature in self._warmed
        warmup_runs = 1 if warmed else self.options.warmup_runs
        if not isinstance(call, PackedCall):
            state = self.plan.key_state(key, call)

        def region() -> Any:
            with self.plan.bound(state):
                return self._captured_region(*args, **kwargs)

        self._done = self.backend.follow(self._done)
        with self._hooks.adopting(), contextlib.ExitStack() as contexts:
            for context in self._capture_contexts():
                contexts.enter_context(context)
            graph, output = self.backend.capture(region, self._pool, warmup_runs)
        if isinstance(call, PackedCall):
            self._warmed.add(call.signature)
        leaves, spec = pytree.tree_flatten(output)
        if not measure:
            costs = None
        elif isinstance(call, PackedCall):
            costs = self._measure_packed(graph, state, leaves, call)
        else:
            costs = self._measure(graph, static, leaves, args, kwargs)
        self._stats.captures += 1
        self._stats.capture_seconds += time.perf_counter() - started
        if costs is not None and not costs.graph_pays:
            self._stats.slower_graphs += 1
            self._entries.measured(lookup, costs)
            return None
        entry = GraphEntry(
            key=key,
            graph=graph,
            static_inputs=static,
            output_leaves=tuple(leaves),
            output_spec=spec,
            not_per_row=None if isinstance(call, PackedCall) else _not_per_row(leaves, key.batch),
            state=state,
            addresses=addresses((*static, *leaves, *_state_tensors(state), *self._watch.tensors)),
            costs=costs,
        )
        if self._entries.add(lookup, entry) is not None:
            self._stats.evictions += 1
        return entry

    def _measure(
        self,
        graph: Any,
        static: Sequence[torch.Tensor],
        leaves: Sequence[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Costs:
        """The fastest of a few eager calls on the graph's inputs, and of a few replays with
        their input copies and output clones, each waited for."""
        rows = static[0].shape[0]
        with self._hooks.adopting():
            eager_ms = min(
                self.backend.time_eager(lambda: self.plan.region(*args, **kwargs), rows)[1]
                for _ in range(_MEASURED_RUNS)
            )

        def replay() -> None:
            _load(static, static)
            self.backend.replay(graph)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    leaf.clone()

        graph_ms = min(self.backend.time_replay(replay, rows) for _ in range(_MEASURED_RUNS))
        return Costs(eager_ms, graph_ms)

    def _measure_packed(
        self, graph: Any, buffers: Any, leaves: Sequence[Any], call: PackedCall
    ) -> Costs:
        """The fastest of a few replays of the budget's graph with the outputs cloned, and of
        one to a few eager calls of ``call`` itself (the plan's region unbound: the model's own
        forward; more only while the replay is not :data:`_DECISIVE` times faster), each waited
        for; no eager call where the fastest eager call observed of about ``call``'s tokens
        (:meth:`_observed_eager_ms`) was already that many times slower than the replay, which
        then stands for it. A measured replay pays what a call served by the graph pays on the
        host too: the call is read again (:meth:`~layergraph.packing.Packing.pack`) and loaded,
        so a plan whose per-call metadata is costly to compute keeps a graph only if it still
        beats the model's own eager call."""
        packing = self.plan.packing

        def replay() -> None:
            packing.load(buffers, packing.pack(call.args, call.kwargs))
            self.backend.replay(graph)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    leaf.clone()

        graph_ms = min(self.backend.time_replay(replay, call.size) for _ in range(_MEASURED_RUNS))
        observed_ms = self._observed_eager_ms(call)
        if observed_ms is not None and graph_ms * _DECISIVE <= observed_ms:
            return Costs(observed_ms, graph_ms)
        eager_ms = float("inf")
        with self._hooks.adopting():
            for _ in range(_MEASURED_RUNS):
                eager_ms = min(
                    eager_ms,
                    self.backend.time_eager(
                        lambda: self.plan.region(*call.args, **call.kwargs), call.size
                    )[1],
                )
                if graph_ms * _DECISIVE <= eager_ms:
                    break
        return Costs(eager_ms, graph_ms)

    def _replay(
        self, entry: GraphEntry, call: CallInputs | PackedCall, fresh: bool, count: bool = False
    ) -> Any:
        """Replay ``entry``'s graph on ``call``'s rows (padded up to its batch, or loaded into
        its budget's buffers); with ``count``, the call's way is counted (chunks count theirs
        once, as a whole)."""
        if self.options.debug:
            self._check_addresses(entry)
        if self.options.static_output and entry.record.held.any_alive():
            self._stats.overwritten_outputs += 1
            warn(
                f"replaying the graph of {entry.key} overwrites outputs of its previous replay "
                f"that are still referenced (static_output=True); clone them to keep them",
                StaleOutputWarning,
            )
        self._done = self.backend.follow(self._done)
        rows = call.batch
        spec = entry.output_spec
        if isinstance(call, PackedCall):
            leaves, spec = self._replay_packed(entry, call)
        else:
            _load(entry.static_inputs, call.tensors)
            self.backend.replay(entry.graph)
            leaves = entry.output_leaves
            if rows < entry.key.batch:  # padded, so every tensor output is one row per input
                leaves = [t[:rows] if isinstance(t, torch.Tensor) else t for t in leaves]
        self._stats.replays += 1
        if rows < entry.key.batch:
            self._stats.padded_calls += 1
        if count:
            way = "graph" if rows == entry.key.batch else f"padded to {entry.key.batch}"
            self._stats.served[(rows, way)] += 1
        if self.options.static_output and not fresh:
            leaves = [
                leaf.view_as(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
            ]
            entry.record.held.track(leaves)
        else:
            leaves = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        output = pytree.tree_unflatten(list(leaves), spec)
        if self.options.validate:
            self._validate_once(entry, call, output)
        return output

    def _replay_packed(
        self, entry: GraphEntry, call: PackedCall
    ) -> tuple[list[Any], pytree.TreeSpec]:
        """Load a packed call into its budget's buffers, replay, and cut its rows out of the
        outputs: the output's leaves (views of the graph's buffers) and structure."""
        packing = self.plan.packing
        packing.load(entry.state, call)
        self.backend.replay(entry.graph)
        whole = pytree.tree_unflatten(list(entry.output_leaves), entry.output_spec)
        return pytree.tree_flatten(packing.cut(whole, call, entry.key.batch))

    def _validate_once(self, entry: GraphEntry, call: CallInputs | PackedCall, output: Any) -> None:
        """Compare the first replay of ``entry``'s graph with eager; drop the graph and raise
        :class:`~layergraph.validation.GraphMismatchError` if they differ."""
        if entry.record.validated:
            return
        if isinstance(call, PackedCall):
            args, kwargs = call.args, call.kwargs
        else:
            args, kwargs = call.rebuild(call.tensors)
        with self._hooks.adopting():
            expected = self.plan.region(*args, **kwargs)
        try:
            compare_outputs(
                output,
                expected,
                tolerance=self.options.tolerance,
                context=f"graph for key {entry.key} (batch {call.batch})",
            )
        except GraphMismatchError:
            self._entries.remove((entry.key.batch, call.signature))
            raise
        entry.record.validated = True

    def _check_addresses(self, entry: GraphEntry) -> None:
        now = addresses(
            (
                *entry.static_inputs,
                *entry.output_leaves,
                *_state_tensors(entry.state),
                *self._watch.tensors,
            )
        )
        if now != entry.addresses:
            moved = sum(a != b for a, b in zip(now, entry.addresses))
            moved += abs(len(now) - len(entry.addresses))
            raise RuntimeError(
                f"debug check: {moved} buffer(s) of the graph for {entry.key} no longer have "
                f"their captured addresses; replaying it would read or write freed memory"
            )

    # ---- ahead-of-time capture, statistics, release -------------------------------------------

    def capture(
        self,
        *args: Any,
        batch_sizes: Sequence[int] | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> list[ShapeKey]:
        """Capture graphs now for the example call's sequence, largest batch first.

        Every size in ``batch_sizes`` (default: the runner's buckets, or the example's batch
        with ``batch_sizes="auto"`` or ``None``) is captured from the example's rows, repeated
        as needed. Capturing the largest first lets the smaller graphs reuse its pool memory.
        Returns the keys of the graphs held: a graph measured slower than eager is not kept
        (``stats.costs`` says by how much).
        """
        if self.plan.packing is not None:
            raise RuntimeError(
                "cannot capture graphs ahead of time for a packed plan: its token budgets are "
                "captured when calls first need them"
            )
        call = CallInputs(args, kwargs)
        reason = self._eager_reason(call)
        if reason is not None:
            raise RuntimeError(f"cannot capture graphs: {reason}")
        self.plan.check_inputs(call)
        sizes = batch_sizes if batch_sizes is not None else self.buckets.sizes or (call.batch,)
        sizes = sorted(BatchBuckets(sizes).sizes or (), reverse=True)
        keys = []
        with self._lock:
            for size in track(sizes, "capturing graphs", enabled=progress):
                rows = torch.arange(size, device=call.tensors[0].device) % call.batch
                example = CallInputs(*call.rebuild([t[rows] for t in call.tensors]))
                lookup = (size, example.signature)
                entry = self._entries.get(lookup)
                if entry is None:
                    if len(sizes) > self.max_graphs:
                        raise RuntimeError(
                            f"cannot capture {len(sizes)} batch sizes with max_graphs="
                            f"{self.max_graphs}"
                        )
                    key = ShapeKey(size, self.plan.sequence_of(example))
                    entry, reason = self._capture(key, lookup, example)
                    if entry is None and self._entries.failure(lookup) is not None:
                        raise RuntimeError(f"cannot capture graphs: {reason}")
                if entry is not None:
                    keys.append(entry.key)
        return keys

    def measurements(self) -> tuple[tuple[Any, Costs], ...]:
        """What the policy measured, by lookup, for a warm start; lookups whose call signature
        cannot be pickled are left out."""
        with self._lock:
            kept = []
            for lookup, costs in self._entries.all_costs().items():
                try:
                    pickle.dumps(lookup)
                except Exception:  # a user's argument value that pickle does not take
                    continue
                kept.append((lookup, costs))
            return tuple(kept)

    def seed(self, measured: Iterable[tuple[Any, Costs]]) -> None:
        """Start from measurements made elsewhere (a warm start): lookups not measured here
        take them, so a batch whose graph was slower than eager is not captured."""
        with self._lock:
            for lookup, costs in measured:
                if self._entries.costs(lookup) is None:
                    self._entries.measured(lookup, costs)

    def accept_current_hooks(self) -> None:
        """Capture graphs with the forward hooks registered now, and let calls with them replay.

        The hooks on the plan's owner, its submodules and PyTorch's global ones become the
        baseline (the constructor's ``hooks``). For the wrapper, after it registers hooks of its
        own. If they differ from the previous baseline, every graph is dropped (an
        invalidation): those graphs hold what the previous hooks did, and lack what the new ones
        do.
        """
        with self._lock:
            if self._hooks.accept():
                self._forget_everything()

    @property
    def keys(self) -> list[ShapeKey]:
        """The keys of the graphs held now."""
        return [entry.key for entry in self._entries]

    def stats(self) -> GraphStats:
        """A snapshot of the statistics, with the pool's current size read from the allocator."""
        with self._lock:
            pool_bytes = self.backend.pool_bytes(self._pool) if self._pool is not None else 0
            return replace(
                self._stats,
                graphs=len(self._entries),
                budgets=self._planner.budgets if self._planner is not None else (),
                eager_calls=self._stats.eager_calls.copy(),
                served=self._stats.served.copy(),
                costs=self._entries.costs_by_batch(),
                pool_bytes=pool_bytes,
            )

    def release(self) -> None:
        """Drop every graph and the pool; the next call captures afresh, with the forward hooks
        the model has then (they become the baseline: no graph holds the older ones)."""
        with self._lock:
            self._entries.clear()
            self._pool = None
            self._hooks.accept()


def _check_budgets(budgets: Sequence[int], unit: int) -> None:
    """Raise ``ValueError`` unless every token budget given is a multiple of the packing's
    ``unit`` (a graph of another budget would pad a real token's group)."""
    bad = [budget for budget in budgets if budget % unit]
    if bad:
        raise ValueError(
            f"token budgets {bad} are not multiples of {unit} tokens, which this model's calls "
            f"come in (batch_sizes of a packed model are token budgets)"
        )


def _state_tensors(state: Any) -> list[Any]:
    """The tensors inside a plan's per-key state (a dataclass, tuple, dict or tensor)."""
    if state is None:
        return []
    if dataclasses.is_dataclass(state):
        state = [getattr(state, f.name) for f in dataclasses.fields(state)]
    return [leaf for leaf in pytree.tree_leaves(state) if isinstance(leaf, torch.Tensor)]


def _load(static: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Copy a call's tensors into a graph's static inputs and zero the padding rows."""
    for buffer, tensor in zip(static, tensors):
        rows = tensor.shape[0]
        if rows == buffer.shape[0]:
            buffer.copy_(tensor)
            continue
        buffer[:rows].copy_(tensor)
        buffer[rows:].zero_()


def _not_per_row(leaves: Sequence[Any], rows: int) -> str | None:
    """Which tensor among an output's ``leaves`` is not one row per input of ``rows`` rows, or
    ``None`` if each is. A tensor whose first dimension equals ``rows`` by coincidence (a mean
    over 4 rows of 4 features) passes."""
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dim() == 0:
            return f"output {index} is 0-d"
        if leaf.shape[0] != rows:
            return f"output {index} has {leaf.shape[0]} rows for {rows} inputs"
    return None


def _not_per_row_reason(problem: str, batch: int, split: bool) -> str:
    """The eager reason of a call that would pad or split outputs that are not one row per
    input."""
    return (
        f"outputs are not one row per input ({problem}): "
        f"batch {batch} is not {'split' if split else 'padded'}"
    )


def _hooks_reason(places: Sequence[str], owner: torch.nn.Module) -> str:
    """The eager reason of a call while the forward hooks at ``places`` differ from those
    graphs are captured with."""
    named = [
        "all modules (global hooks)"
        if place == GLOBAL_HOOKS
        else place or f"the {type(owner).__name__} itself"
        for place in places
    ]
    listed = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return f"forward hooks changed after wrapping (on {listed}); they run only in eager calls"


class _NotPerRow(Exception):
    """Chunk outputs that cannot be joined along the batch; the message says which output."""


def _concatenate(parts: Sequence[Any], rows: Sequence[int]) -> Any:
    """Join the outputs of consecutive batch chunks, of ``rows`` rows each, along the batch.

    Raises :class:`_NotPerRow` rather than join a tensor that is not one row per input in every
    chunk, or keep one chunk's value of anything else that differs between chunks.
    """
    flat = [pytree.tree_flatten(part) for part in parts]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise _NotPerRow("the chunks' outputs differ in structure")
    for (leaves, _), count in zip(flat, rows):
        problem = _not_per_row(leaves, count)
        if problem is not None:
            raise _NotPerRow(problem)
    joined = []
    for index, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        if isinstance(column[0], torch.Tensor):
            joined.append(torch.cat(column))
        elif all(value == column[0] for value in column):
            joined.append(column[0])
        else:
            raise _NotPerRow(f"output {index} differs between chunks")
    return pytree.tree_unflatten(joined, spec)
