"""Latency of a callable: medians of many timed calls, with CUDA events on a GPU."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "captured_ms",
    "interleaved_waited_ms",
    "matmul_peak_tflops",
    "median_ms",
    "timed_call",
    "waited_ms",
]


def median_ms(
    fn: Callable[[], Any], *, device: torch.device, warmup: int = 10, iters: int = 100
) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after ``warmup`` untimed calls.

    On a CUDA device each call is bracketed by its own pair of CUDA events on the current
    stream, so the time is what the GPU spent from the call's first launch to its last kernel;
    elsewhere it is wall-clock time.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in pairs)
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def waited_ms(
    fn: Callable[[], Any], *, device: torch.device, warmup: int = 10, iters: int = 100
) -> float:
    """Median milliseconds of ``iters`` calls of ``fn``, each followed by a wait for its result.

    What a caller that needs each result before going on (a serving call, before the language
    model runs) feels: on a CUDA device each call is bracketed by two CUDA events on an idle
    stream and the end event is waited for, so the host work before the call's first launch
    counts, where :func:`median_ms`'s back-to-back calls hide it behind the GPU's work.
    Elsewhere it is wall-clock time, as for :func:`median_ms`.
    """
    if device.type != "cuda":
        return median_ms(fn, device=device, warmup=warmup, iters=iters)
    for _ in range(warmup):
        fn()
    return statistics.median(_waited_calls(fn, device, iters))


def timed_call(fn: Callable[[], Any], *, device: torch.device) -> tuple[Any, float]:
    """One call of ``fn``, waited for: its output and its milliseconds, between two CUDA events
    on a CUDA device (the host work before its first launch counts, as for
    :func:`waited_ms`), by the wall clock elsewhere. For streams of calls that differ, each
    timed once; :func:`waited_ms` is the median of one call repeated."""
    if device.type != "cuda":
        started = time.perf_counter()
        output = fn()
        return output, (time.perf_counter() - started) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    output = fn()
    end.record()
    end.synchronize()
    return output, start.elapsed_time(end)


def interleaved_waited_ms(
    fns: Mapping[str, Callable[[], Any]],
    *,
    device: torch.device,
    rounds: int = 5,
    iters: int = 20,
    warmup: int = 1,
) -> dict[str, float]:
    """Median waited milliseconds of each of ``fns`` (as :func:`waited_ms` times one), taken
    in turns: ``rounds`` rounds, each running ``iters`` calls of every callable in a rotated
    order, so that what drifts during a run (clocks, the host's load) weighs on all of them
    alike and their ratios hold. Returns the median of each one's calls, by name."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += _waited_calls(fns[name], device, iters)
    return {name: statistics.median(values) for name, values in times.items()}


def _waited_calls(fn: Callable[[], Any], device: torch.device, iters: int) -> list[float]:
    """Milliseconds of ``iters`` calls of ``fn``, each waited for (CUDA events on a GPU)."""
    times = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    for _ in range(iters):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return times


def captured_ms(
    fn: Callable[[], Any],
    *,
    device: torch.device,
    warmup: int = 3,
    calls: int = 10,
    replays: int = 5,
) -> float:
    """Median milliseconds per call of ``fn`` inside a CUDA graph, where launches cost nothing.

    ``fn`` is called ``warmup`` times, then ``calls`` calls are captured into one graph, which
    is replayed ``replays`` times, each replay timed with CUDA events. CUDA only; the graph is
    captured under whatever settings are active (an SDPA backend choice, say).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


@functools.cache
def matmul_peak_tflops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192
) -> float:
    """The TFLOP/s this device's large matrix products reach: the median of timed
    ``size``-square products of ``dtype`` (bf16 by default), measured once per process and
    device. What a graph's achieved rate (``stats.achieved_tflops``) is a fraction of; the card's
    data-sheet figure is higher than any product reaches. A CUDA device only."""
    if device.type != "cuda":
        raise ValueError(f"the matrix-product peak is measured on a CUDA device, not {device}")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    milliseconds = median_ms(lambda: a @ b, device=device, warmup=5, iters=20)
    return 2 * size**3 / milliseconds / 1e9
