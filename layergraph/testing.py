"""Tools for testing adapters and the runner without a GPU.

:class:`SimulatedGraphs` is a graph backend for CPU tensors that keeps the contract of a CUDA
graph: a replay recomputes the captured function from the *static* input buffers and writes
the result into the *static* output buffers captured the first time. A runner that forgot to
copy an input, or returned a buffer it should have cloned, gives wrong answers here as it would
on a GPU. It does not simulate kernels, streams or memory pools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["SimulatedGraphs"]


@dataclass
class _SimulatedGraph:
    fn: Callable[[], Any]
    output: Any
    pool: list[Any] = field(repr=False)


class SimulatedGraphs:
    """A graph backend that serves CPU tensors by re-running the captured function."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        self.memory_releases = 0

    def unavailable_reason(self) -> str | None:
        return None

    def is_capturing(self) -> bool:
        return False

    def new_pool(self) -> list[Any]:
        return []

    def capture(self, fn: Callable[[], Any], pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        for _ in range(warmup_runs):
            fn()
        output = fn()
        pool.append(output)
        self.captures += 1
        return _SimulatedGraph(fn, output, pool), output

    def replay(self, graph: _SimulatedGraph) -> None:
        with torch.inference_mode():  # a real replay writes its buffers in any grad mode
            fresh = pytree.tree_leaves(graph.fn())
            for static, value in zip(pytree.tree_leaves(graph.output), fresh):
                if isinstance(static, torch.Tensor):
                    static.copy_(value)
        self.replays += 1

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, MemoryError) or "out of memory" in str(error)

    def release_memory(self) -> None:
        self.memory_releases += 1

    def mark_done(self) -> None:
        return None

    def wait_for(self, marker: Any) -> None:
        return None

    def pool_bytes(self, pool: list[Any]) -> int:
        return sum(
            leaf.untyped_storage().nbytes()
            for output in pool
            for leaf in pytree.tree_leaves(output)
            if isinstance(leaf, torch.Tensor)
        )
