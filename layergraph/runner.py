"""The graph runner: one CUDA graph per shape key, a shared pool, padding and eager fallback.

A thin façade over the parts that do the work: the eager-reason gate
(:mod:`layergraph.serving.gate`),
the engine that captures, measures and replays one key (:mod:`layergraph.serving.engine`), and the
lane that chooses which key serves a call, batched (:mod:`layergraph.serving.batched_lane`) or
packed (:mod:`layergraph.serving.packed_lane`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

from .adapter import CapturePlan
from .graphs import GraphBackend
from .guards import HookFingerprint
from .keys import ShapeKey, UnsupportedCall
from .options import DEFAULT_BATCH_SIZES, DEFAULT_MAX_GRAPHS, RunnerOptions
from .rows import RowPacking
from .serving.batched_lane import BatchedLane
from .serving.budgets import PACKED_MAX_GRAPHS
from .serving.engine import CaptureFailedWarning, GraphEngine, StaleOutputWarning
from .serving.fusion import LayerFusion
from .serving.lane import Lane
from .serving.packed_lane import PackedLane
from .serving.policy import Costs, FusionChoice
from .serving.pool import PoolShare
from .stats import GraphStats

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "CaptureFailedWarning",
    "GraphInfo",
    "GraphRunner",
    "RunnerOptions",
    "StaleOutputWarning",
]


@dataclass(frozen=True)
class GraphInfo:
    """One graph a wrapped model holds, as :attr:`~layergraph.module.GraphedModule.graphs`
    lists it: a snapshot, for inspection and tests; replays go through the wrapper."""

    key: ShapeKey
    """The graph's key: its batch size (or token budget) and sequence."""
    signature: Any
    """What fixes the graph besides its key: how arguments are passed, fixed values."""
    buffers: Any
    """The buffers the graph reads, whose addresses it baked in: for a plan keyed by batch
    size a :class:`~layergraph.rows.RowBuffers` (``inputs``, the plan's ``state``); for a
    packed plan, what its packing allocated."""
    outputs: tuple[Any, ...]
    """The graph's output buffers, flattened (the outputs of a replay are cut from these)."""
    costs: Costs | None
    """Its replay and an eager call, as measured; ``None`` until the first call it serves
    measured a packed budget captured ahead."""
    flops: int | None
    """The floating-point operations of one replay (its key's whole work, padding included;
    :mod:`layergraph.flops`); ``None`` if not counted."""
    fusion: FusionChoice | None
    """Whether it holds compiled layers, and why (``compile_layers="auto"``); ``None``
    without compiled layers chosen by measurement."""
    validated: bool
    """Whether a replay was compared with eager and agreed (``validate=True``)."""
    uses: int
    """Calls that needed it, halved with every count of the cache."""


class GraphRunner:
    """Serves calls of one capture plan from CUDA graphs, one per shape key.

    Workflow of a call: the engine's packing reads it (a batch's tensors and the fixed rest,
    :class:`~layergraph.keys.CallInputs`; or a packed plan's
    :class:`~layergraph.packing.PackedCall`); the gate (:class:`~layergraph.serving.gate.EagerGate`)
    says why a graph cannot serve it (no CUDA, training mode, gradients, another device or
    dtype, unsupported arguments), and such a call runs the plan's region eagerly, counted
    with its reason. Otherwise the lane maps it to its graph or graphs (its own, a bucket,
    chunks, a token budget: ``batch_sizes``), the engine finds or captures the key's graph,
    loads the call into its buffers (padding zeroed), replays it on the caller's stream and
    cuts the call's rows out of the outputs, which are cloned unless ``static_output`` is set.

    Each capture measures the graph's replay against an eager call of the same batch
    (:class:`~layergraph.serving.policy.Costs`); a graph slower than eager is dropped and its batch
    runs eagerly from then on. With ``batch_sizes="auto"`` those measurements also choose how
    a batch without a graph of its own is served (:mod:`layergraph.serving.policy`).

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
        eager_checks: Sequence[Callable[[], str | None]] = (),
        pools: PoolShare | None = None,
        fusion: LayerFusion | None = None,
    ) -> None:
        self.plan = plan
        self.options = options
        self.backend = backend
        packed = plan.packing is not None
        self.max_graphs = options.max_graphs or (
            PACKED_MAX_GRAPHS if packed else DEFAULT_MAX_GRAPHS
        )
        """The most graphs held at once (``max_graphs``, or its default for the plan)."""
        self._engine = GraphEngine(
            plan,
            options,
            backend,
            plan.packing if packed else RowPacking(plan),
            self.max_graphs,
            captured_region,
            hooks,
            capture_contexts,
            eager_checks,
            pools,
            fusion,
        )
        self._lane: Lane = (
            PackedLane(self._engine, plan.packing) if packed else BatchedLane(self._engine)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine
        try:
            call = engine.packing.pack(args, kwargs)
        except UnsupportedCall as unsupported:
            return engine.run_eagerly(str(unsupported), args, kwargs, explain_errors=True)
        with engine.lock:
            if engine.model_changed():
                self._lane.forget()
            reason = engine.gate.reason(call)
            if reason is None:
                return self._lane.serve(call, fresh=False)
        engine.gate.warn_of_mode(call)
        explain = reason.startswith("input ")  # the model would fail on such inputs
        return engine.run_eagerly(
            reason, args, kwargs, explain_errors=explain, size=call.size, call=call
        )

    def count_eager(self, reason: str, size: int | None = None) -> None:
        """Count an eager run made outside the runner for ``reason`` (and ``size``'s way)."""
        with self._engine.lock:
            self._engine.count_eager(reason, size)

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
        as needed. For a packed plan the sizes are token budgets, each captured from the
        example's images that fit it (:meth:`~layergraph.serving.packed_lane.PackedLane.capture`).
        Capturing the largest first lets the smaller graphs reuse its pool memory. Returns the
        keys of the graphs held: a graph not measured faster than eager is not kept
        (``stats.costs`` says by how much).
        """
        try:
            call = self._engine.packing.pack(args, kwargs)
        except UnsupportedCall as unsupported:
            raise RuntimeError(f"cannot capture graphs: {unsupported}") from None
        reason = self._engine.gate.reason(call)
        if reason is not None:
            raise RuntimeError(f"cannot capture graphs: {reason}")
        with self._engine.lock:
            return self._lane.capture(call, batch_sizes, progress)

    def measurements(self) -> tuple[tuple[Any, Costs], ...]:
        """What the policy measured, by lookup, for a warm start; lookups whose call signature
        cannot be pickled are left out."""
        with self._engine.lock:
            kept = []
            for lookup, costs in self._engine.held.all_costs().items():
                try:
                    pickle.dumps(lookup)
                except Exception:  # a user's argument value that pickle does not take
                    continue
                kept.append((lookup, costs))
            return tuple(kept)

    def token_totals(self) -> tuple[tuple[int, int], ...]:
        """A packed plan's calls by token total, which its learnt budgets were chosen from, for
        a warm start; empty for batched plans and given budgets."""
        with self._engine.lock:
            return self._lane.token_totals()

    def seed(
        self,
        measured: Iterable[tuple[Any, Costs]],
        token_totals: Sequence[tuple[int, int]] = (),
        token_budgets: Sequence[int] = (),
    ) -> None:
        """Start from what was measured elsewhere (a warm start): lookups not measured here
        take its measurements, so a batch whose graph was slower than eager is not captured
        and one that pays is not measured again; a packed plan learning its budgets starts
        from that process's ``token_budgets`` and the ``token_totals`` they were chosen from
        (:meth:`token_totals`) instead of observing calls first."""
        with self._engine.lock:
            self._engine.take_costs(measured)
            if token_totals:
                self._lane.start_from(token_totals, token_budgets)

    def accept_current_hooks(self) -> None:
        """Capture graphs with the forward hooks registered now, and let calls with them replay.

        The hooks on the plan's owner, its submodules and PyTorch's global ones become the
        baseline (the constructor's ``hooks``). For the wrapper, after it registers hooks of its
        own. If they differ from the previous baseline, every graph is dropped (an
        invalidation): those graphs hold what the previous hooks did, and lack what the new ones
        do.
        """
        with self._engine.lock:
            if self._engine.hooks.accept():
                self._engine.forget("model")
                self._lane.forget()

    @property
    def keys(self) -> list[ShapeKey]:
        """The keys of the graphs held now."""
        return [entry.key for entry in self._engine.held]

    def graphs(self) -> tuple[GraphInfo, ...]:
        """The graphs held now, least recently used first (:class:`GraphInfo`)."""
        fusion = self._engine.fusion
        with self._engine.lock:
            return tuple(
                GraphInfo(
                    key=entry.key,
                    signature=lookup[1],
                    buffers=entry.buffers,
                    outputs=entry.output_leaves,
                    costs=entry.costs,
                    flops=self._engine.held.flops(lookup),
                    fusion=fusion.choice_of(entry) if fusion is not None else None,
                    validated=entry.record.validated,
                    uses=entry.record.uses,
                )
                for lookup, entry in self._engine.held.items()
            )

    def stats(self) -> GraphStats:
        """A snapshot of the statistics, with the pool's current size read from the allocator."""
        engine = self._engine
        with engine.lock:
            pool = engine.pools.holding(engine)
            pool_bytes = self.backend.pool_bytes(pool) if pool is not None else 0
            return replace(
                engine.stats,
                graphs=len(engine.held),
                budgets=self._lane.budgets,
                eager_calls=engine.stats.eager_calls.copy(),
                served=engine.stats.served.copy(),
                costs=engine.held.costs_by_batch(),
                flops=engine.held.flops_by_batch(),
                fusion=self._fusion_by_size(),
                pool_bytes=pool_bytes,
            )

    def _fusion_by_size(self) -> dict[int, FusionChoice]:
        """What each held graph's key holds, compiled layers or as built, by size; empty
        without compiled layers chosen by measurement."""
        fusion = self._engine.fusion
        if fusion is None:
            return {}
        held = sorted(self._engine.held.items(), key=lambda item: item[0][0])
        return {lookup[0]: fusion.choice_of(entry) for lookup, entry in held}

    def finish_compiling(self, timeout: float | None = None) -> bool:
        """Wait for a background compile of the layers, if one runs (at most ``timeout``
        seconds); whether none runs now. The keys take the compiled code at their next call."""
        fusion = self._engine.fusion
        return True if fusion is None else fusion.wait(timeout)

    def release(self) -> None:
        """Drop every graph and the pool; the next call captures afresh, with the forward hooks
        the model has then (they become the baseline: no graph holds the older ones). Waits
        for a background compile of the layers first."""
        self.finish_compiling()
        with self._engine.lock:
            self._engine.forget("knowledge")
            self._engine.hooks.accept()
