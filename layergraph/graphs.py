"""The seam between the runner and CUDA: capture, replay and pool accounting.

The runner decides *what* to capture and *when*; a graph backend does the CUDA calls. Keeping
the CUDA calls behind this small protocol lets the runner's logic (keys, padding, statistics,
eager fallback) run on the CPU with :class:`layergraph.testing.SimulatedGraphs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .capture_lanes import CaptureLane, take_lane

__all__ = ["CudaGraph", "CudaGraphs", "CudaPool", "GraphBackend"]


class GraphBackend(Protocol):
    """What the runner needs from a graph implementation."""

    device_type: str
    """The device type whose tensors this backend captures (``"cuda"``)."""

    def unavailable_reason(self) -> str | None:
        """Why no graph can be captured in this process, or ``None`` if graphs work."""

    def is_capturing(self) -> bool:
        """Whether the current stream is already being captured (by someone else's graph)."""

    def new_pool(self) -> Any:
        """A fresh memory pool that all graphs of one wrapped model share."""

    def capture(self, fn: Callable[[], Any], pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        """Run ``fn`` eagerly ``warmup_runs`` times, then capture it; return (graph, output)."""

    def replay(self, graph: Any) -> None:
        """Launch ``graph`` on the caller's current stream."""

    def pool_bytes(self, pool: Any) -> int:
        """Bytes the device allocator has reserved for ``pool``."""

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether ``error`` says the device ran out of memory."""

    def release_memory(self) -> None:
        """Give memory no longer held by any graph or tensor back to the device."""

    def time_eager(self, fn: Callable[[], Any], rows: int) -> tuple[Any, float]:
        """Run ``fn``, an eager call of ``rows`` rows, waiting for the device before and
        after; return its result and the milliseconds it took."""

    def time_replay(self, fn: Callable[[], Any], rows: int) -> float:
        """Milliseconds of ``fn``, a replay of a graph of ``rows`` rows with its input copies,
        waited for as in :meth:`time_eager`."""

    def follow(self, previous: Any) -> Any:
        """Order the caller's stream after the previous call's work, ``previous`` being what
        this method returned then (``None`` at first); return the marker of this call."""


@dataclass(eq=False)
class CudaPool:
    """A memory pool that graphs share, and the capture lane they are captured on.

    The lane (:class:`~layergraph.capture_lanes.CaptureLane`) is taken at the pool's first
    capture and goes back to the free list once the pool and all its graphs are collected.
    """

    handle: Any
    """The pool's id, from ``torch.cuda.graph_pool_handle()``."""
    lane: CaptureLane | None = None


@dataclass(eq=False)
class CudaGraph:
    """A captured graph, holding its pool (and so the pool's lane) for as long as it lives."""

    graph: torch.cuda.CUDAGraph
    pool: CudaPool


class CudaGraphs:
    """Graph backend on ``torch.cuda.CUDAGraph``.

    Warm-up runs on a side stream, so that lazy initialisation inside the model happens outside
    the capture. It is one stream per device for the whole process: cuBLAS keeps a workspace of
    tens of MiB for every stream it has run on, so a new stream per capture would leave a
    workspace behind each time. Capture runs on the stream of the pool's capture lane
    (:mod:`layergraph.capture_lanes`), whose cuBLAS workspaces outlive the pool's graphs, and
    replay is launched on whichever stream is current for the caller.
    Calls from different streams are ordered through an event (:meth:`follow`), since their
    replays share static buffers.
    """

    device_type = "cuda"

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None
        """Recorded on the previous call's stream when a call comes on another one."""

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def new_pool(self) -> CudaPool:
        return CudaPool(torch.cuda.graph_pool_handle())

    def capture(
        self, fn: Callable[[], Any], pool: CudaPool, warmup_runs: int
    ) -> tuple[CudaGraph, Any]:
        device = torch.cuda.current_device()
        side = _warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        if pool.lane is None:
            pool.lane = take_lane(device, pool)
        pool.lane.pin()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool.handle, stream=pool.lane.stream):
            output = fn()
        return CudaGraph(graph, pool), output

    def replay(self, graph: CudaGraph) -> None:
        graph.graph.replay()

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)

    def release_memory(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def time_eager(self, fn: Callable[[], Any], rows: int) -> tuple[Any, float]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        return result, (time.perf_counter() - started) * 1e3

    def time_replay(self, fn: Callable[[], Any], rows: int) -> float:
        return self.time_eager(fn, rows)[1]

    def follow(self, previous: Any) -> Any:
        """The marker is the stream of the call. A call on another stream than the previous
        one records an event on that stream (after the previous call's work, and whatever
        was queued there since) and waits for it; a call on the same stream has nothing to
        wait for, its work runs in order."""
        stream = torch.cuda.current_stream()
        if previous is not None and stream != previous:
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(previous)
            stream.wait_event(self._event)
        return stream

    def pool_bytes(self, pool: CudaPool) -> int:
        pool_id = tuple(pool.handle)
        return sum(
            segment["total_size"]
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment.get("segment_pool_id", ())) == pool_id
        )


_warmup_streams: dict[int, torch.cuda.Stream] = {}


def _warmup_stream(device: int) -> torch.cuda.Stream:
    """The side stream that every capture on ``device`` warms up on."""
    if device not in _warmup_streams:
        _warmup_streams[device] = torch.cuda.Stream(device)
    return _warmup_streams[device]
