"""The graph engine: captures, measures, replays, validates and checks the graphs of one plan.

The engine owns what every graph of a wrapped model shares: the memory pool, the lock calls
are served under, the statistics, the graph cache (:class:`~layergraph.serving.cache.GraphCache`)
and the watches that notice a model changed under its graphs. It knows one
:class:`~layergraph.packing.Packing`, through which every call reaches a graph: a packed
plan's own, or :class:`~layergraph.rows.RowPacking` for batches. It does not choose which
graph serves a call: the lanes do (:mod:`layergraph.serving.batched_lane`,
:mod:`layergraph.serving.packed_lane`), asking the engine for the entry of one budget
(:meth:`GraphEngine.entry_for`) and to replay it (:meth:`GraphEngine.replay`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from ..adapter import CapturePlan
from ..device_factories import MadeOnDevice, copies_from_host
from ..flops import count_flops
from ..graphs import GraphBackend, GraphCaptureError
from ..guards import HookFingerprint, HookWatch, ParameterWatch, addresses
from ..keys import ShapeKey
from ..options import RunnerOptions
from ..packing import Call, Packing, buffer_tensors
from ..rebuild import Rebuilds
from ..stats import GraphStats
from ..validation import GraphMismatchError, compare_outputs
from ..warn import warn
from .cache import GraphCache, GraphEntry, HeldGraphs, aliases, storages
from .fusion import COMPILING_REASON, LayerFusion, capture_turn, uncompiled
from .gate import EagerGate
from .lane import Lane
from .policy import ROUTE_MARGIN, Costs
from .pool import PoolShare

__all__ = [
    "CaptureFailedWarning",
    "GraphEngine",
    "Lane",
    "StaleOutputWarning",
]

_MEASURED_RUNS = 3
"""Eager calls and replays timed at each capture; the fastest of each is kept."""

_DECISIVE = 1.5
"""A capture times one eager call, and more (up to :data:`_MEASURED_RUNS`) only while the
fastest replay is not this many times faster than the fastest eager call: further eager calls
could only come out faster than a first one slowed by half, which is rare."""


class StaleOutputWarning(UserWarning):
    """A replay overwrote outputs of an earlier replay that the caller still held."""


class CaptureFailedWarning(UserWarning):
    """A shape's capture failed though its eager runs did not (an operator a CUDA stream capture
    refuses, a host read, a synchronisation): its calls run eagerly. Warned once per failure."""


class GraphEngine:
    """Captures, measures, replays and validates the graphs of one plan, one budget at a time.

    A graph's entry (:class:`~layergraph.serving.cache.GraphEntry`) owns everything about its key:
    the graph, the packing's buffers (inputs, metadata, workspaces: the addresses it baked in),
    the output buffers, the costs measured and what replays established. Each capture is
    measured against an eager call (:meth:`_measure`); a graph not measured faster than eager
    is not kept.

    Lanes call the engine under :attr:`lock`. :attr:`eager_stand_in` lets a lane supply an
    eager time observed earlier for a call, which stands for the eager call a capture would
    otherwise time when the replay beats it decisively.
    """

    def __init__(
        self,
        plan: CapturePlan,
        options: RunnerOptions,
        backend: GraphBackend,
        packing: Packing[Any],
        max_graphs: int,
        captured_region: Callable[..., Any] | None = None,
        hooks: HookFingerprint | None = None,
        capture_contexts: Callable[[], Sequence[AbstractContextManager[Any]]] | None = None,
        eager_checks: Sequence[Callable[[], str | None]] = (),
        pools: PoolShare | None = None,
        fusion: LayerFusion | None = None,
    ) -> None:
        self.plan = plan
        self.options = options
        self.backend = backend
        self.packing = packing
        self._rebuild = Rebuilds()
        self.max_graphs = max_graphs
        self._captured_region = captured_region or plan.region
        """What warm-up and capture run: the plan's region, or a compiled version of it."""
        self._capture_contexts = capture_contexts or tuple
        """The contexts plugins enter around each warm-up and capture."""
        self._cache = GraphCache(max_graphs, options.capture_after)
        """Every graph, and everything known about each key: its graph with that graph's
        validation, its sightings, or its failed capture."""
        self.stats = GraphStats(size_unit=packing.size_unit)
        self.lock = threading.RLock()
        self.hooks = HookWatch(plan.owner, hooks)
        """The forward hooks graphs are captured with, and whether the model's differ now."""
        self._watch = ParameterWatch(plan.owner)
        self.gate = EagerGate(plan, backend, self.hooks, eager_checks)
        self.pools = pools or PoolShare(backend)
        """The pool this engine's graphs are captured into, shared with the other engines of
        a wrapper of several towers."""
        self.pools.join(self)
        self._done: Any = None
        self._warmed: set[Any] = set()
        """Call signatures captured since the model last changed: the lazy initialisation of
        their kernels has run, so a packing whose budgets share kernels warms them up once."""
        self.eager_stand_in: Callable[[Call], float | None] = lambda call: None
        self.fusion = fusion
        """Which keys hold compiled layers (``compile_layers="auto"``); ``None`` without."""
        self._made_on_device = False
        """Whether captures make the tensors the model makes without a device on the device
        (:class:`~layergraph.device_factories.MadeOnDevice`): set once a capture failed at a
        copy from the host and its second try, so made, succeeded."""

    @property
    def held(self) -> HeldGraphs:
        """The graphs held and what is known of each key, to read; they change through the
        engine alone."""
        return self._cache

    def take_costs(self, measured: Iterable[tuple[Hashable, Costs]]) -> None:
        """Take the measurements of keys not measured here (a warm start's)."""
        for lookup, costs in measured:
            if self._cache.costs(lookup) is None:
                self._cache.record_costs(lookup, costs)

    # ---- the model under the graphs -----------------------------------------------------------

    def model_changed(self) -> bool:
        """Whether the model's parameters moved since the last call; if so every graph, and
        all that was known of every key, is forgotten (the lanes forget theirs)."""
        if not self._watch.changed():
            return False
        self.forget("model")
        self.gate.refresh()
        return True

    def forget(self, scope: Literal["graphs", "knowledge", "model"]) -> None:
        """The one way to forget. ``"graphs"``: drop every graph and the pool (the next capture
        starts a new pool), keeping what is known of each key (sightings, costs, failures).
        ``"knowledge"``: that too (``GraphedModule.release()``). ``"model"``: the model changed
        under the graphs (parameters moved, hooks accepted): that too, and which signatures
        were warmed up, an invalidation counted if any graph was held (the lane forgets its
        own, :meth:`Lane.forget`)."""
        if scope == "model" and len(self._cache):
            self.stats.invalidations += 1
        if scope == "graphs":
            self._cache.drop_graphs()
        else:
            self._cache.clear()
        if scope == "model":
            self._warmed.clear()
        if scope != "graphs" and self.fusion is not None:
            self.fusion.forget()

    def keep_budgets(self, budgets: Sequence[int]) -> None:
        """Drop the graphs of budgets not in ``budgets`` (a new plan of learnt budgets); the
        pool goes with the last graph."""
        self._cache.keep_buckets(budgets)

    # ---- eager calls --------------------------------------------------------------------------

    def count_eager(self, reason: str, size: int | None) -> None:
        """Count an eager call for ``reason`` (and ``size``'s way, when known)."""
        self.stats.eager_calls[reason] += 1
        if size is not None:
            self.stats.served[(size, "eager")] += 1

    def run_eagerly(
        self,
        reason: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        explain_errors: bool = False,
        size: int | None = None,
        call: Call | None = None,
    ) -> Any:
        """Run the region eagerly, counting ``reason`` (and ``size``'s way, when known).

        With ``explain_errors``, an error raised by the model is re-raised as a ``ValueError``
        that names ``reason`` first (an input unlike the model's), the model's error chained.
        Given the ``call``, an error raised by the model is re-raised as the ``ValueError`` of
        the plan's :meth:`~layergraph.adapter.CapturePlan.check_inputs` where that refuses the
        call (the message a capture would give), the model's error chained.
        """
        self.count_eager(reason, size)
        with self.hooks.adopting():
            try:
                return self.plan.region(*args, **kwargs)
            except Exception as error:
                if explain_errors:
                    raise ValueError(
                        f"{reason}; the model raised {type(error).__name__}: {error}"
                    ) from error
                if call is not None:
                    self._explain(call, error)
                raise

    def _explain(self, call: Call, error: Exception) -> None:
        """Raise the plan's own refusal of ``call`` (a ``ValueError``), the model's ``error``
        chained, if the plan refuses it; return otherwise."""
        try:
            self.plan.check_inputs(call)
        except ValueError as refusal:
            raise ValueError(
                f"{refusal} (the model raised {type(error).__name__}: {error})"
            ) from error

    def time_eagerly(self, reason: str, call: Call) -> tuple[Any, float]:
        """Run ``call`` eagerly, counted for ``reason``, waited for and timed: its output and
        milliseconds."""
        self.count_eager(reason, call.size)
        args, kwargs = call.arguments()
        with self.hooks.adopting():
            return self.backend.time_eager(lambda: self.plan.region(*args, **kwargs), call.size)

    def other_way_pays(
        self, call: Call, size: int, reason: str, other_ms: float, other: str
    ) -> tuple[bool, Any]:
        """Whether ``call``, which no graph of its own key (``size``, its signature) serves
        (``reason``), is to go ``other``'s way (graphs held for its signature, measured at
        ``other_ms``): ``(True, None)`` where that was measured faster than eager by
        :data:`~layergraph.serving.policy.ROUTE_MARGIN`. Otherwise ``(False, output)``, the call
        served eagerly: timed on its key's first eager call (the eager time recorded), else counted
        with ``reason`` and why ``other`` was not taken. The measured fallback of both lanes."""
        lookup = (size, call.signature)
        costs = self._cache.costs(lookup)
        if costs is None:
            output, eager_ms = self.time_eagerly(reason, call)
            self._cache.record_costs(lookup, Costs(eager_ms))
            return False, output
        if other_ms >= costs.eager_ms * ROUTE_MARGIN:
            reason = f"{reason}; {other} were not measured faster than eager"
            args, kwargs = call.arguments()
            return False, self.run_eagerly(reason, args, kwargs, size=call.size)
        return True, None

    # ---- the entry of one budget --------------------------------------------------------------

    def entry_for(self, budget: int, call: Call) -> tuple[GraphEntry | None, str]:
        """The graph of ``budget`` for calls like ``call``, captured now if admitted; else
        ``None`` and why the call cannot have it."""
        lookup = (budget, call.signature)
        entry = self._cache.get(lookup)
        if entry is not None:
            return self._reviewed(lookup, entry, call), ""
        failure = self._cache.failure(lookup)
        if failure is not None:
            return None, failure
        costs = self._cache.costs(lookup)
        if costs is not None and costs.graph_ms is not None and not costs.graph_pays:
            return None, slower_reason(budget)
        self.plan.check_inputs(call)
        key = ShapeKey(budget, self.plan.sequence_of(call))
        if not self.options.lazy:
            return None, f"no graph captured for {key} and lazy capture is off"
        refusal = self._cache.admit(lookup)
        if refusal is not None:
            return None, refusal
        entry, reason = self.capture(budget, call)
        return (entry and self._reviewed(lookup, entry, call)), reason

    def _reviewed(
        self, lookup: tuple[int, Any], entry: GraphEntry, call: Call, ahead: bool = False
    ) -> GraphEntry:
        """The entry that serves ``lookup``: with compiled layers chosen by measurement, the
        faster of its graphs once both were measured (:class:`~.fusion.LayerFusion`)."""
        if self.fusion is None:
            return entry
        return self.fusion.review(self, lookup, entry, call, ahead)

    def capture(
        self, budget: int, call: Call, measure: bool = True, wait: bool = False
    ) -> tuple[GraphEntry | None, str]:
        """Capture the graph of ``budget`` from ``call`` (measured unless ``measure`` is off);
        return its entry, or ``None`` and why its call runs eagerly: a background compile
        holds the device (:func:`~.fusion.capture_turn`; ``wait`` waits for it).

        A capture that runs out of memory drops every graph. One that fails otherwise after its
        warm-up runs, eager runs of the same inputs, succeeded (the backend's
        :class:`~layergraph.graphs.GraphCaptureError`) is recorded and warned about, or, with
        ``validate``, raises the capture's error. Any other error (the warm-up's: the model's
        own) is raised as it is.
        """
        key = ShapeKey(budget, self.plan.sequence_of(call))
        lookup = (budget, call.signature)
        try:
            with capture_turn(wait) as turn:
                if not turn:
                    return None, COMPILING_REASON
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
                return None, slower_reason(budget)
            return entry, ""
        if self.backend.is_out_of_memory(cause):
            return None, self._out_of_memory(key, lookup)
        if self.options.validate:
            raise cause
        return None, self._capture_failed(key, lookup, failed)

    def capture_ahead(self, budget: int, call: Call, sizes: int) -> GraphEntry | None:
        """The graph of ``budget`` for calls like ``call``, held or captured now (measured),
        for a capture ahead of ``sizes`` sizes in all; ``None`` where it was measured slower
        than eager. Raises ``RuntimeError`` where ``sizes`` do not fit ``max_graphs`` or the
        capture failed."""
        lookup = (budget, call.signature)
        entry = self._cache.get(lookup)
        if entry is None:
            if sizes > self.max_graphs:
                raise RuntimeError(
                    f"cannot capture {sizes} sizes with max_graphs={self.max_graphs}"
                )
            entry, reason = self.capture(budget, call, wait=True)
            if entry is None and self._cache.failure(lookup) is not None:
                raise RuntimeError(f"cannot capture graphs: {reason}")
        return entry and self._reviewed(lookup, entry, call, ahead=True)

    def settle(self, entry: GraphEntry, call: Call) -> tuple[GraphEntry | None, str]:
        """Measure a graph captured unmeasured on ``call``, the first it serves; keep it if it
        pays, else drop it (its costs kept)."""
        lookup = (entry.key.batch, call.signature)
        started = time.perf_counter()
        costs = self._measure(entry, call)
        self.stats.capture_seconds += time.perf_counter() - started
        kept = self._cache.keep_if_it_pays(lookup, costs)
        if kept is not None:
            return kept, ""
        self.stats.slower_graphs += 1
        return None, slower_reason(entry.key.batch)

    def _out_of_memory(self, key: ShapeKey, lookup: tuple[int, Any]) -> str:
        """Drop every graph and the pool after ``key``'s capture ran out of memory, and record
        the failure; return the reason its calls run eagerly."""
        reason = f"capture of {key} ran out of device memory"
        self.forget("graphs")
        self.backend.release_memory()
        self._cache.fail(lookup, reason)
        self.stats.failed_captures += 1
        return reason

    def _capture_failed(
        self, key: ShapeKey, lookup: tuple[int, Any], failed: GraphCaptureError
    ) -> str:
        """Record that ``key`` cannot be captured, for the reason ``failed`` gives, and warn;
        return the reason its calls run eagerly. The other graphs and the pool stay."""
        reason = f"capture of {key} failed: {failed}"
        self._cache.fail(lookup, reason)
        self.stats.failed_captures += 1
        warn(
            f"{reason}; calls of this shape run eagerly until the model changes or the graphs "
            f"are released (graphed.stats counts them; validate=True raises the error instead)",
            CaptureFailedWarning,
        )
        return reason

    def _capture_entry(
        self, key: ShapeKey, lookup: tuple[int, Any], call: Call, measure: bool
    ) -> GraphEntry | None:
        """Capture and measure ``key``'s graph; store and return it, or, if it was not
        measured faster than eager, record the costs and return ``None``. Without ``measure`` it is
        stored unmeasured, its costs ``None``, until :meth:`settle`. A graph of a lookup whose
        replay was measured before (by a warm start's process, or an earlier graph of the same
        lookup in this one) takes that measurement instead of being measured again."""
        entry = self.capture_graph(lookup, call)
        started = time.perf_counter()
        known = self._cache.costs(lookup)
        if known is not None and known.graph_ms is not None:
            costs: Costs | None = known
        elif measure:
            costs = self._measure(entry, call)
        else:
            costs = None
        self.stats.capture_seconds += time.perf_counter() - started
        if costs is not None and not costs.graph_pays:
            self.stats.slower_graphs += 1
            self._cache.record_costs(lookup, costs)
            return None
        entry = replace(entry, costs=costs)
        if self._cache.add(lookup, entry) is not None:
            self.stats.evictions += 1
        return entry

    def prepared_region(self, budget: int, call: Call) -> tuple[Callable[[], Any], Any]:
        """What warm-up and capture run for ``budget``: the captured region on fresh buffers of
        the packing (:meth:`~layergraph.packing.Packing.allocate`) loaded with ``call``, the
        plan's state bound; and those buffers."""
        packing = self.packing
        with torch.inference_mode(False):
            buffers = packing.allocate(budget, call)
        packing.load(buffers, call)
        args, kwargs = packing.arguments(buffers)
        state = packing.plan_state(buffers)
        device = next((tensor.device for tensor in buffer_tensors(buffers)), None)

        def region() -> Any:
            with self.plan.bound(state), contextlib.ExitStack() as made:
                if self._made_on_device and device is not None:
                    made.enter_context(MadeOnDevice(device))
                return self._captured_region(*args, **kwargs)

        return region, buffers

    def capture_graph(self, lookup: tuple[int, Any], call: Call) -> GraphEntry:
        """Capture the graph of ``lookup`` from ``call`` into the pool, warmed up, unmeasured
        and not stored; its FLOPs counted at the lookup's first capture. Raises what the
        warm-up or the capture raised. The seconds counted include the buffers' allocation
        (where a plan times its attention backends)."""
        started = time.perf_counter()
        region, buffers = self.prepared_region(lookup[0], call)
        warmup_runs = self.options.warmup_runs
        if self.packing.later_warmup_runs is not None and call.signature in self._warmed:
            warmup_runs = self.packing.later_warmup_runs
        device = next((tensor.device for tensor in buffer_tensors(buffers)), None)
        self._done = self.backend.follow(self._done)
        with self.hooks.adopting(), contextlib.ExitStack() as contexts:
            for context in self._capture_contexts():
                contexts.enter_context(context)
            if self._cache.flops(lookup) is None:  # a warm-up run's, compiled code uncompiled
                with uncompiled():  # Dynamo met under a dispatch mode may skip the code for good
                    self._cache.record_flops(lookup, count_flops(region))
                if warmup_runs > 1:
                    warmup_runs -= 1
            try:
                with self.pools.capturing(self) as pool:
                    graph, output = self.backend.capture(region, pool, warmup_runs)
            except GraphCaptureError as failed:
                if self._made_on_device or device is None or not copies_from_host(failed):
                    raise
                self._made_on_device = True  # and again, in a fresh pool if none is held
                try:
                    with self.pools.capturing(self) as pool:
                        graph, output = self.backend.capture(region, pool, 1)
                except GraphCaptureError:
                    self._made_on_device = False
                    raise
        self._warmed.add(call.signature)
        leaves, spec = pytree.tree_flatten(output)
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - started
        key = ShapeKey(lookup[0], self.plan.sequence_of(call))
        return GraphEntry(
            key=key,
            graph=graph,
            buffers=buffers,
            output_leaves=tuple(leaves),
            output_spec=spec,
            not_per_row=self.packing.output_problem(leaves, key.batch),
            addresses=self._addresses(buffers, leaves),
            storages=storages((*buffer_tensors(buffers), *leaves)),
        )

    def swap(self, lookup: tuple[int, Any], entry: GraphEntry) -> GraphEntry:
        """Serve ``lookup`` from ``entry`` in place of the graph held for it; return it."""
        return self._cache.swap(lookup, entry)

    def _addresses(self, buffers: Any, leaves: Sequence[Any]) -> tuple[int, ...]:
        """Data pointers of every buffer a graph reads or writes, and the model's tensors."""
        return addresses((*buffer_tensors(buffers), *leaves, *self._watch.tensors))

    def replay_ms(self, entry: GraphEntry, call: Call) -> float:
        """The fastest of a few waited replays of ``entry``'s graph on ``call``, paying what a
        call served by it pays on the host: the call read again
        (:meth:`~layergraph.packing.Packing.pack`) and loaded, the outputs cloned."""
        packing = self.packing
        own = call.arguments()

        def replay() -> None:
            packing.load(entry.buffers, packing.pack(*own))
            self.backend.replay(entry.graph)
            for leaf in entry.output_leaves:
                if isinstance(leaf, torch.Tensor):
                    leaf.clone()

        rows = packing.measured_size(call, entry.key.batch)
        return min(self.backend.time_replay(replay, rows) for _ in range(_MEASURED_RUNS))

    def _measure(self, entry: GraphEntry, call: Call) -> Costs:
        """The replay (:meth:`replay_ms`) and the fastest of one to a few eager calls
        (:meth:`~layergraph.packing.Packing.measured_arguments`; more only while the replay
        is not :data:`_DECISIVE` times faster), each waited for. No eager call where a time
        the lane observed for such a call (:attr:`eager_stand_in`) was already that many times
        slower than the replay, which then stands for it. A plan whose per-call work is costly
        keeps a graph only if it still beats eager."""
        graph_ms = self.replay_ms(entry, call)
        observed_ms = self.eager_stand_in(call)
        if observed_ms is not None and graph_ms * _DECISIVE <= observed_ms:
            return Costs(observed_ms, graph_ms)
        rows = self.packing.measured_size(call, entry.key.batch)
        args, kwargs = self.packing.measured_arguments(entry.buffers, call)
        eager_ms = float("inf")
        with self.hooks.adopting():
            for _ in range(_MEASURED_RUNS):
                timed = self.backend.time_eager(lambda: self.plan.region(*args, **kwargs), rows)
                eager_ms = min(eager_ms, timed[1])
                if graph_ms * _DECISIVE <= eager_ms:
                    break
        return Costs(eager_ms, graph_ms)

    # ---- replay -------------------------------------------------------------------------------

    def replay(self, entry: GraphEntry, call: Call, fresh: bool, count: bool = False) -> Any:
        """Replay ``entry``'s graph on ``call`` (loaded into its buffers, padded past its size)
        and cut the call's rows out of the outputs; ``fresh`` forces cloned outputs. With
        ``count``, the call's way is counted (a split call counts its way once, as a whole)."""
        if self.options.debug:
            self._check_addresses(entry)
        if self.options.static_output and entry.record.held.any_alive():
            self.stats.overwritten_outputs += 1
            warn(
                f"replaying the graph of {entry.key} overwrites outputs of its previous replay "
                f"that are still referenced (static_output=True); clone them to keep them",
                StaleOutputWarning,
            )
        self._done = self.backend.follow(self._done)
        budget = entry.key.batch
        self.packing.load(entry.buffers, call)
        self.backend.replay(entry.graph)
        leaves, spec = self.packing.cut_leaves(entry.output_leaves, entry.output_spec, call, budget)
        size = call.size
        self.stats.replays += 1
        if size < budget:
            self.stats.padded_calls += 1
        if count:
            way = "graph" if size == budget else f"padded to {budget}"
            self.stats.served[(size, way)] += 1
        if self.options.static_output and not fresh:
            leaves = [
                leaf.view_as(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
            ]
            entry.record.held.track(leaves)
        else:
            leaves = [leaf.clone() if aliases(leaf, entry.storages) else leaf for leaf in leaves]
        output = self._rebuild(leaves, spec)
        if self.options.validate:
            self._validate_once(entry, call, output)
        return output

    def _validate_once(self, entry: GraphEntry, call: Call, output: Any) -> None:
        """Compare the first replay of ``entry``'s graph with eager; drop the graph and raise
        :class:`~layergraph.validation.GraphMismatchError` if they differ."""
        if entry.record.validated:
            return
        args, kwargs = call.arguments()
        with self.hooks.adopting():
            expected = self.plan.region(*args, **kwargs)
        try:
            compare_outputs(
                output,
                expected,
                tolerance=self.options.tolerance,
                context=f"graph for key {entry.key} (batch {call.size})",
            )
        except GraphMismatchError:
            self._cache.remove((entry.key.batch, call.signature))
            raise
        entry.record.validated = True

    def _check_addresses(self, entry: GraphEntry) -> None:
        now = self._addresses(entry.buffers, entry.output_leaves)
        if now != entry.addresses:
            moved = sum(a != b for a, b in zip(now, entry.addresses))
            moved += abs(len(now) - len(entry.addresses))
            raise RuntimeError(
                f"debug check: {moved} buffer(s) of the graph for {entry.key} no longer have "
                f"their captured addresses; replaying it would read or write freed memory"
            )


def slower_reason(budget: int) -> str:
    """The eager reason of a call whose graph was not measured faster than eager."""
    return f"the graph of batch {budget} was not measured faster than eager"
