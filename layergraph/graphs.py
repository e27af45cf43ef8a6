"""The seam between the runner and CUDA: capture, replay and pool accounting.

The runner decides *what* to capture and *when*; a graph backend does the CUDA calls. Keeping
the CUDA calls behind this small protocol lets the runner's logic (keys, padding, statistics,
eager fallback) run on the CPU with :class:`layergraph.testing.SimulatedGraphs`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from .capture_streams import CaptureStream, take_stream

__all__ = [
    "CudaGraph",
    "CudaGraphs",
    "CudaPool",
    "GraphBackend",
    "GraphCaptureError",
    "side_stream",
]


class GraphCaptureError(RuntimeError):
    """A capture that failed after its warm-up runs of the same function succeeded: the function
    runs eagerly but cannot be captured (an operator a CUDA stream capture refuses, a read of a
    value on the host, a synchronisation). ``__cause__`` is the error the capture raised.

    A backend raises it only once nothing of the capture is left but the tensors that the
    traceback still refers to: no capture in progress, no graph, no share of the pool held for
    it. Errors of the warm-up runs are the model's own and are raised as they are, not as this.
    """

    @classmethod
    def caused_by(cls, error: BaseException) -> GraphCaptureError:
        """The error for a capture that failed with ``error`` (to raise ``from error``): its
        message is ``error``'s type, the first line of its message (CUDA's errors add lines of
        advice) and the innermost line outside PyTorch and layergraph that it was raised in,
        the model's line where the model raised it or called the operator that did."""
        lines = str(error).strip().splitlines()
        message = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        where = _model_line(error)
        return cls(f"{message} (in {where})" if where else message)


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
        """Run ``fn`` eagerly ``warmup_runs`` times, then capture it; return (graph, output).

        Raises :class:`GraphCaptureError` if the capture fails after the warm-up runs did not.
        """

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
    """A memory pool that graphs share, and the capture stream they are captured on.

    The capture stream (:class:`~layergraph.capture_streams.CaptureStream`) is taken at the
    pool's first capture and goes back to the free list once the pool and all its graphs are
    collected.
    """

    handle: Any
    """The id that captures allocate from, from ``torch.cuda.graph_pool_handle()``."""
    capture_stream: CaptureStream | None = None
    retired: list[Any] = field(default_factory=list)
    """Earlier ids of the pool, which graphs captured before still use and no capture can
    allocate from any more (:meth:`renew`)."""

    def renew(self) -> None:
        """Capture into a new id from now on: a failed capture left PyTorch recording into the
        current one, where a later capture into it is refused ("already recording to
        mempool_id")."""
        self.retired.append(self.handle)
        self.handle = torch.cuda.graph_pool_handle()


@dataclass(eq=False)
class CudaGraph:
    """A captured graph, holding its pool (and so the pool's capture stream) while it lives."""

    graph: torch.cuda.CUDAGraph
    pool: CudaPool


class CudaGraphs:
    """Graph backend on ``torch.cuda.CUDAGraph``.

    Warm-up runs on a side stream, so that lazy initialisation inside the model happens outside
    the capture. It is one stream per device for the whole process: cuBLAS keeps a workspace of
    tens of MiB for every stream it has run on, so a new stream per capture would leave a
    workspace behind each time. Capture runs on the pool's capture stream
    (:mod:`layergraph.capture_streams`), whose cuBLAS workspaces outlive the pool's graphs, and
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
        side = side_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        if pool.capture_stream is None:
            pool.capture_stream = take_stream(device, pool)
        pool.capture_stream.pin()
        graph = torch.cuda.CUDAGraph()
        try:
            output = _capture_on(graph, pool, fn)
        except Exception as error:
            raise GraphCaptureError.caused_by(error) from error
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
        """The marker is the call's stream, as the ``(stream id, device index, device type)``
        that PyTorch keeps for the current device: read once a call without building a ``Stream``,
        whose construction costs far more than the read. A call on another stream than the
        previous one records an event on that stream (after the previous call's work, and
        whatever was queued there since) and waits for it; a call on the same stream has
        nothing to wait for, its work runs in order."""
        marker = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        if previous is not None and marker != previous:
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(_stream_of(previous))
            _stream_of(marker).wait_event(self._event)
        return marker

    def pool_bytes(self, pool: CudaPool) -> int:
        pool_ids = {tuple(handle) for handle in (pool.handle, *pool.retired)}
        return sum(
            segment["total_size"]
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment.get("segment_pool_id", ())) in pool_ids
        )


def _stream_of(marker: tuple[int, int, int]) -> torch.cuda.Stream:
    """The ``Stream`` of a marker of :meth:`CudaGraphs.follow`."""
    stream_id, device_index, device_type = marker
    return torch.cuda.Stream(
        stream_id=stream_id, device_index=device_index, device_type=device_type
    )


def _capture_on(graph: torch.cuda.CUDAGraph, pool: CudaPool, fn: Callable[[], Any]) -> Any:
    """Capture ``fn`` into ``graph`` on ``pool``'s capture stream, allocating from ``pool``;
    return its output.

    What ``torch.cuda.graph`` does (wait for the device, empty the cache, capture on the
    stream), except where the capture fails: ``torch.cuda.graph``'s exit then ends the capture
    with an error of its own in place of the first, and on PyTorch 2.11 leaves the capture
    stream current, the allocators recording into the pool (every later capture into it is
    refused) and the default generator refusing random numbers outside a capture ("Offset
    increment outside graph capture"). Here the capture is abandoned (:func:`_abandon`) and
    the first error raised.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.cuda.stream(pool.capture_stream.stream):
        try:
            graph.capture_begin(pool=pool.handle)
        except BaseException:
            # It puts the default generator in capture mode before it can fail.
            _release_default_generator(torch.cuda.current_device())
            raise
        try:
            output = fn()
            graph.capture_end()
        except BaseException:
            _abandon(graph, pool)
            raise
    return output


def _abandon(graph: torch.cuda.CUDAGraph, pool: CudaPool) -> None:
    """Leave nothing of a failed capture into ``pool`` on the current stream: end the stream's
    capture if it is still under way; where PyTorch's ``capture_end`` failed before it stopped
    the allocators recording into the pool, stop the device's, give back the capture's use of
    the pool and :meth:`~CudaPool.renew` it (the pinned-host allocator's recording cannot be
    stopped from Python); release ``graph``; put the device's default generator back out of
    capture mode; and wait for the device.

    Memory the capture allocated returns to the pool once the tensors holding it are gone (the
    caller's traceback holds some); it does not free the pool, which other graphs may share.
    """
    device = torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        # The capture is over either way: an invalidated capture ends with an error.
        with contextlib.suppress(RuntimeError):
            graph.capture_end()
    if _stop_allocating_to(device, pool.handle):
        # capture_end failed before the point where it stops the allocators, and so before
        # the point where reset() gives back the capture's use of the pool.
        torch._C._cuda_releasePool(device, pool.handle)
        pool.renew()
        _stranded.append(graph)
    graph.reset()
    _release_default_generator(device)
    torch.cuda.synchronize()


_stranded: list[torch.cuda.CUDAGraph] = []
"""Graphs of captures that left the pinned-host allocator recording into their pool: it keeps
a filter that refers to the graph object, so the object, reset, is kept for as long as the
process runs, one per such failure (on PyTorch 2.11 a failure left 1 KiB of device memory
allocated, taken to be held by it)."""


def _stop_allocating_to(device: int, pool: Any) -> bool:
    """Stop the device's allocator sending allocations to the pool id ``pool`` for a capture;
    whether it still did (it does not once ``capture_end`` got past ending the capture)."""
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError as error:
        if "not currently recording" not in str(error):
            raise
        return False
    return True


def _release_default_generator(device: int) -> None:
    """Give ``device``'s default generator a state out of capture mode, with the same seed and
    offset, if a failed capture left its state in capture mode (it then refuses every random
    number drawn outside a capture). Graphs captured before keep the state they drew from.

    It does nothing to a generator that draws: it checks by drawing one number, and puts the
    generator's state back after.
    """
    generator = torch.cuda.default_generators[device]
    state = generator.get_state()
    try:
        torch.empty(1, device=device).uniform_(generator=generator)
    except RuntimeError as error:
        if "outside graph capture" not in str(error):
            raise
        fresh = torch.Generator(device=torch.device("cuda", device))
        fresh.set_state(state)
        generator.graphsafe_set_state(fresh)
    else:
        generator.set_state(state)


_NOT_THE_MODEL = ("torch", "layergraph")
"""Packages whose frames :meth:`GraphCaptureError.caused_by` passes over to name the model's."""


def _model_line(error: BaseException) -> str | None:
    """``function (file:line)`` of the innermost frame of ``error``'s traceback outside
    :data:`_NOT_THE_MODEL`, or ``None`` if every frame is inside."""
    found = None
    entry = error.__traceback__
    while entry is not None:
        module = entry.tb_frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _NOT_THE_MODEL:
            code = entry.tb_frame.f_code
            name = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11
            found = f"{name} ({Path(code.co_filename).name}:{entry.tb_lineno})"
        entry = entry.tb_next
    return found


_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: int) -> torch.cuda.Stream:
    """The side stream that every capture on ``device`` warms up on, and background compiles
    run on (:mod:`layergraph.serving.fusion`): one per device, since each stream keeps a cuBLAS
    workspace."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]
