"""Progress for long work: a progress bar for captures (rich's, when rich is installed and the
caller wants one), and a status line that a pipe sees too."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["status", "track"]

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


@contextlib.contextmanager
def status(console: Any, message: str) -> Iterator[Callable[[str], None]]:
    """Say ``message`` while the block runs: a spinner on a terminal (a rich ``Console``), a
    printed line where the output is a pipe, which would show nothing of a spinner. Yields the
    function that replaces the message (on a pipe, prints the new one)."""
    if console.is_terminal:
        with console.status(message) as shown:
            yield shown.update
        return
    console.print(message, highlight=False)
    yield lambda text: console.print(text, highlight=False)
