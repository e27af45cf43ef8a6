"""What a plan rewrites in a model while it is wrapped.

A rewrite changes how one part of the model computes (a routed forward, a forward hook) without
changing its parameters or what it returns beyond rounding. Plans attach their rewrites when
they route the model to the graphs and detach them when they undo the routing, so eager
comparisons (``GraphedModule.original()``) and ``unwrap()`` see the model as it was.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Rewrite"]


class Rewrite(Protocol):
    """One part of the model, rewritten while attached; attaching twice changes nothing."""

    def attach(self) -> None: ...

    def detach(self) -> None: ...
