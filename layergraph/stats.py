"""Statistics of one wrapped model: what was captured, what replayed, and what ran eagerly."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["GraphStats"]


@dataclass
class GraphStats:
    """Counters a wrapped model keeps for its whole life.

    ``eager_calls`` maps each reason a call could not be served by a graph (no CUDA, training
    mode, an uncaptured shape...) to how many calls ran eagerly for it. ``pool_bytes`` is the
    memory the shared graph pool holds, read from the allocator when the statistics are taken.
    ``evictions``: graphs dropped as least recently used; ``invalidations``: times every graph
    was dropped because the model's parameters moved; ``failed_captures``: captures that ran
    out of memory; ``overwritten_outputs``: replays that overwrote a still-held static output.
    """

    graphs: int = 0
    captures: int = 0
    replays: int = 0
    padded_calls: int = 0
    split_calls: int = 0
    evictions: int = 0
    invalidations: int = 0
    failed_captures: int = 0
    overwritten_outputs: int = 0
    eager_calls: Counter[str] = field(default_factory=Counter)
    capture_seconds: float = 0.0
    pool_bytes: int = 0

    @property
    def eager_total(self) -> int:
        """Calls that ran eagerly, whatever the reason."""
        return sum(self.eager_calls.values())

    def __str__(self) -> str:
        lines = [
            f"graphs={self.graphs} captures={self.captures} replays={self.replays} "
            f"padded={self.padded_calls} split={self.split_calls} eager={self.eager_total} "
            f"evicted={self.evictions} invalidated={self.invalidations} "
            f"failed={self.failed_captures} "
            f"pool={self.pool_bytes / 2**20:.1f} MiB capture={self.capture_seconds:.3f} s"
        ]
        lines += [f"  eager x{n}: {reason}" for reason, n in self.eager_calls.most_common()]
        return "\n".join(lines)
