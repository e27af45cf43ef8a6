"""A progress bar for long captures: rich's, when rich is installed and the caller wants one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["track"]

T = TypeVar("T")


def track(items: Sequence[T], description: str, *, enabled: bool) -> Iterator[T]:
    """Iterate ``items``, showing a transient progress bar on stderr when possible."""
    if enabled:
        try:
            from rich.console import Console
            from rich.progress import track as rich_track
        except ImportError:
            pass
        else:
            yield from rich_track(
                items, description=description, console=Console(stderr=True), transient=True
            )
            return
    yield from items
