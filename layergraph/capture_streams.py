"""Capture streams whose cuBLAS workspaces outlive every graph that uses them.

PyTorch gives cuBLAS (and cuBLASLt) one workspace per cuBLAS handle and stream, allocated at
first use and cached until ``torch._C._cuda_clearCublasWorkspaces()``; a captured matrix
product keeps the workspace's address. Where the first use on a stream happens inside a
capture, the workspace is allocated in that capture's pool, and every later capture on the
stream borrows it. Once that pool is gone and the cache is cleared (torch.compile clears it when
it records its own graphs), the workspace is freed, ``empty_cache`` unmaps it, and the
borrowing graphs fault at replay.

A :class:`CaptureStream` is a stream of its own plus a small *anchor* graph captured on it, into
a pool of its own, that is never released. Before each capture, :meth:`CaptureStream.pin` runs a
few matrix products in a throwaway capture into the anchor pool, so that whichever workspaces
the current thread's handle lacks on its stream are allocated there. That memory stays
reserved for as long as the anchor lives: a cleared cache frees the workspace into the anchor
pool, never back to the device. A capture stream serves one graph pool at a time (two pools
replayed on different streams would otherwise share a workspace) and goes back to its device's
free list when that pool is collected, so a process holds as many capture streams as it ever
held pools at once, not one per pool it ever made.

What a capture stream does not cover: a workspace that an operation other than the pinned matrix
products allocates per stream is allocated in the capturing pool, as it would be anywhere.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CaptureStream", "free_streams", "take_stream"]

_CU_STREAM_NON_BLOCKING = 1


@dataclass(eq=False)
class CaptureStream:
    """A private capture stream on one device, and the anchor pool that owns its workspaces."""

    device: int
    stream: torch.cuda.ExternalStream
    anchor_pool: Any
    anchor: torch.cuda.CUDAGraph | None = field(default=None, repr=False)

    def pin(self) -> None:
        """Make sure this thread's cuBLAS and cuBLASLt workspaces for its stream live in
        the anchor pool; call it right before capturing on :attr:`stream`."""
        with torch.cuda.device(self.device), torch.inference_mode():
            # float16: matrix products in it run on every GPU with CUDA graphs; the
            # workspaces are per handle and stream, whatever the dtype.
            weight = torch.ones(16, 16, device=self.device, dtype=torch.float16)
            bias = torch.ones(16, device=self.device, dtype=torch.float16)
            graph = torch.cuda.CUDAGraph()
            # capture_begin rather than torch.cuda.graph, which collects garbage and empties
            # the cache on entry: too slow to do twice per capture.
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.anchor_pool)
                try:
                    torch.mm(weight, weight)  # cuBLAS
                    torch.nn.functional.linear(weight, weight, bias)  # cuBLASLt, with bias
                    torch.mm(weight.float(), weight.float())
                finally:
                    graph.capture_end()
        if self.anchor is None:
            self.anchor = graph  # keeps the anchor pool, and so its workspaces, alive


_free_streams: dict[int, list[CaptureStream]] = {}
_lock = threading.Lock()


def take_stream(device: int, owner: object) -> CaptureStream:
    """A capture stream on ``device`` for ``owner`` (a graph pool) alone, back on the free list once
    ``owner`` is garbage collected."""
    capture = _pop_free(device)
    if capture is None:
        gc.collect()  # a pool that is garbage in a reference cycle still holds its capture stream
        capture = _pop_free(device)
    if capture is None:
        capture = CaptureStream(device, _new_stream(device), torch.cuda.graph_pool_handle())
    weakref.finalize(owner, _give_back, capture)
    return capture


def _pop_free(device: int) -> CaptureStream | None:
    with _lock:
        free = _free_streams.setdefault(device, [])
        return free.pop() if free else None


def free_streams(device: int) -> int:
    """How many capture streams on ``device`` are free now (all of them once no pool is alive)."""
    with _lock:
        return len(_free_streams.get(device, []))


def _give_back(capture: CaptureStream) -> None:
    with _lock:
        _free_streams.setdefault(capture.device, []).append(capture)


def _new_stream(device: int) -> torch.cuda.ExternalStream:
    """A non-blocking CUDA stream on ``device`` that no other code has, made by the driver.

    ``torch.cuda.Stream()`` hands out streams from a small ring shared with the rest of the
    process, whose cuBLAS workspaces another capture may have placed in its own pool. The
    stream is never destroyed: the workspace cache keys on its address.
    """
    driver = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    stream = ctypes.c_void_p()
    with torch.cuda.device(device):
        status = driver.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING)
    if status != 0:
        raise RuntimeError(f"cuStreamCreate failed with CUDA driver error {status}")
    return torch.cuda.ExternalStream(stream.value, device=device)
