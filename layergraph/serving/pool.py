"""The memory pool a wrapper's graphs share, handed to its engines.

A wrapped model has one engine, a wrapper of several towers one per tower
(:mod:`layergraph.towers`); every graph any of them captures allocates from one pool, so that
graphs that never run at once reuse the same memory. A capture takes the pool under the share's
lock, so that two engines never capture into it at once.

A pool is taken anew only when no engine holds a graph in it: PyTorch's allocator refuses to
capture into a pool whose graphs were all released while any of its memory is still held (an
output kept by a caller, a cached cuBLAS workspace).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sized
from typing import Any, Protocol

from ..graphs import GraphBackend

__all__ = ["PoolHolder", "PoolShare"]


class PoolHolder(Protocol):
    """What the share asks of an engine: the graphs it holds (their count)."""

    @property
    def held(self) -> Sized: ...


class PoolShare:
    """One memory pool for the graphs of the engines that :meth:`join` it."""

    def __init__(self, backend: GraphBackend) -> None:
        self._backend = backend
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.pool: Any = None
        """The pool graphs are captured into now; ``None`` before the first capture."""

    def join(self, holder: PoolHolder) -> None:
        """Let ``holder`` capture into the shared pool."""
        self._members.add(holder)

    @contextlib.contextmanager
    def capturing(self, holder: PoolHolder) -> Iterator[Any]:
        """The pool for one capture of ``holder``, held by no other capture meanwhile: the pool
        of the graphs held, or a fresh one where no member holds any."""
        with self._lock:
            if self.pool is None or not any(len(member.held) for member in self._members):
                self.pool = self._backend.new_pool()
            yield self.pool

    def holding(self, holder: PoolHolder) -> Any:
        """The pool ``holder``'s graphs live in, or ``None`` while it holds none."""
        return self.pool if len(holder.held) else None
