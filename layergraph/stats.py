"""Statistics of one wrapped model: what was captured, what replayed, and what ran eagerly."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .flops import tflops
from .serving.policy import Costs, FusionChoice

__all__ = ["GraphStats"]


@dataclass
class GraphStats:
    """Counters a wrapped model keeps for its whole life, read with ``graphed.stats``.

    A snapshot: the counters do not move after it was taken. ``graphs`` and ``pool_bytes`` are
    read when it is taken; every other field counts from the wrapping on, and is not reset by
    ``release()``.
    """

    graphs: int = 0
    """Graphs held when the statistics were taken (at most ``max_graphs``)."""
    captures: int = 0
    """Graphs captured, ahead of time (``capture()``) or on first use, including those since
    dropped."""
    replays: int = 0
    """Graph launches; a call split into chunks counts one per chunk."""
    padded_calls: int = 0
    """Replays of a graph captured for more rows than the call had: the call's rows were padded
    with zero rows, and those rows sliced off the outputs."""
    split_calls: int = 0
    """Calls larger than every batch size, served by several replays of the largest graph whose
    outputs were concatenated. A call whose outputs could not be joined and that ran eagerly
    instead is counted in :attr:`eager_calls`, not here."""
    evictions: int = 0
    """Graphs displaced by a shape seen more often than they were used, to keep at most
    ``max_graphs``."""
    invalidations: int = 0
    """Times every graph was dropped because the model's parameters or buffers moved or were
    replaced (``model.to(...)``, ``load_state_dict(..., assign=True)``), or because the forward
    hooks graphs are captured with were changed (``accept_current_hooks()``)."""
    slower_graphs: int = 0
    """Graphs measured slower than an eager call of their own batch at capture, and dropped:
    their batch runs eagerly (or, with ``batch_sizes="auto"``, through other graphs where
    those are faster)."""
    failed_captures: int = 0
    """Captures that failed: ran out of device memory (each dropped every graph), or raised
    what the warm-up runs of the same inputs did not, such as an operator a CUDA stream capture
    refuses (the other graphs stay). Each key runs eagerly until the model changes or the
    graphs are released; :attr:`eager_calls` names the reason."""
    overwritten_outputs: int = 0
    """Replays, with ``static_output=True``, that overwrote outputs of the previous replay of
    the same graph while the caller still referenced them (each also warned)."""
    eager_calls: Counter[str] = field(default_factory=Counter)
    """Calls that ran the model eagerly, by reason ("model is in training mode", "shape not yet
    seen 2 times (capture_after)"...). :attr:`eager_total` is their sum."""
    size_unit: str = "batch"
    """What the sizes of :attr:`served` and :attr:`costs` count: ``"batch"`` (rows), or
    ``"tokens"`` for a packed plan, whose sizes are a call's tokens and whose graphs are token
    budgets."""
    served: Counter[tuple[int, str]] = field(default_factory=Counter)
    """Calls by batch size (by tokens for a packed plan) and the way each was served:
    ``"graph"`` (its own), ``"padded to 16"``, ``"chunks 32+8"`` (several graphs), ``"eager"``
    (the reason is in :attr:`eager_calls`). Calls that ran eagerly before their batch was known
    (arguments a graph cannot take) are only in :attr:`eager_calls`."""
    costs: dict[int, Costs] = field(default_factory=dict)
    """What was measured, by batch size: an eager call and a replay of the batch's own graph
    (at capture), or an eager call alone (a batch served through other graphs or eagerly);
    read when the statistics were taken, forgotten when the model changes."""
    flops: dict[int, int] = field(default_factory=dict)
    """The floating-point operations of one replay of each size's graph (batch size or token
    budget; padding included), counted before its first capture by PyTorch's formulas
    (:mod:`layergraph.flops`: a floor, since operators without a formula count nothing);
    forgotten when the model changes. :attr:`achieved_tflops` sets them against the replays
    measured."""
    fusion: dict[int, FusionChoice] = field(default_factory=dict)
    """What each held graph holds, by size, with compiled layers chosen by measurement
    (``compile_layers="auto"``, :mod:`layergraph.serving.fusion`): its layers compiled or as
    built, and why (``"3.1 ms compiled against 4.2 ms as built"``, ``"compiling in the
    background"``); read when the statistics were taken, empty without."""
    budgets: tuple[int, ...] = ()
    """A packed plan's token budgets learnt from the traffic (``batch_sizes="auto"``), read
    when the statistics were taken; graphs are captured for them as calls need them."""
    replans: int = 0
    """Times a packed plan's token budgets were chosen (again), the graphs of budgets left out
    dropped."""
    compile_seconds: float = 0.0
    """Wall-clock seconds of the calls of compiled code (``compile_layers``,
    ``compile_region``) during which Dynamo compiled: what compiling cost this process
    (:attr:`GraphedModule.compile_budget <layergraph.module.GraphedModule.compile_budget>`'s
    ``spent``; a warm start's process spends less)."""
    capture_seconds: float = 0.0
    """Wall-clock seconds spent capturing, for every capture (those of graphs dropped since
    included): the graph's buffers (a packed plan times its attention backends there), warm-up
    runs, the capture and its measurement against eager."""
    pool_bytes: int = 0
    """Bytes the shared graph memory pool holds, read from the allocator when the statistics
    were taken; 0 before the first capture and after every graph was dropped at once."""

    @property
    def achieved_tflops(self) -> dict[int, float]:
        """TFLOP/s of each size's graph where its replay was measured (:attr:`costs`):
        :attr:`flops` over the replay's time as a caller waits for it (input copies and output
        clones included). On a GPU, compare with its matrix products' peak
        (:func:`layergraph.timing.matmul_peak_tflops`)."""
        return {
            size: tflops(flops, self.costs[size].graph_ms)  # type: ignore[arg-type]
            for size, flops in self.flops.items()
            if size in self.costs and self.costs[size].graph_ms
        }

    @property
    def eager_total(self) -> int:
        """Calls that ran eagerly, whatever the reason."""
        return sum(self.eager_calls.values())

    def __str__(self) -> str:
        lines = [
            f"graphs={self.graphs} captures={self.captures} replays={self.replays} "
            f"padded={self.padded_calls} split={self.split_calls} eager={self.eager_total} "
            f"evicted={self.evictions} invalidated={self.invalidations} "
            f"slower={self.slower_graphs} failed={self.failed_captures} "
            f"pool={self.pool_bytes / 2**20:.1f} MiB capture={self.capture_seconds:.3f} s"
            + (f" compile={self.compile_seconds:.1f} s" if self.compile_seconds else "")
        ]
        if self.budgets:
            lines.append(
                f"  budgets {', '.join(map(str, self.budgets))} (chosen {self.replans} times)"
            )
        lines += [f"  eager x{n}: {reason}" for reason, n in self.eager_calls.most_common()]
        for batch in sorted(
            {batch for batch, _ in self.served} | set(self.costs) | set(self.fusion)
        ):
            ways = ", ".join(
                f"{way} x{n}" for (size, way), n in self.served.most_common() if size == batch
            )
            measured = f" ({self.costs[batch]})" if batch in self.costs else ""
            if batch in self.flops:
                rate = self.achieved_tflops.get(batch)
                measured += f", {self.flops[batch] / 1e9:.3g} GFLOP" + (
                    f" at {rate:.3g} TFLOP/s" if rate is not None else ""
                )
            if batch in self.fusion:
                measured += f"; {self.fusion[batch]}"
            size = f"batch {batch}" if self.size_unit == "batch" else f"{batch} {self.size_unit}"
            lines.append(f"  {size}: {ways or 'not called'}{measured}")
        return "\n".join(lines)
