"""Methods of a model besides ``forward`` served from graphs, each keyed by its name.

For plans whose model is called by several methods that each suit a graph (timm's
``forward_features``, ``forward_head`` and ``forward_intermediates`` next to ``forward``):
while wrapped, each method of the model's class named in :class:`RoutedMethods` is routed to
the runner with its name as the call's first argument, so a call of another method (or of the
same method with other fixed arguments) gets its own graph and its own count in ``stats``.
Only calls made through the wrapper (``graphed.forward_features(x)``, inside the plan's forward
scope) are routed: the model called directly runs its own methods. The plan's region calls the
class's own method; while it runs (an eager call, a capture), the methods it reaches inside
(``forward`` calling ``forward_features``) are the class's own too, so a region is captured
whole rather than re-entering the runner.

It does not serve a method the class lacks, nor attributes set on the instance.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

from layergraph.keys import CallInputs
from layergraph.ledger import ChangeLedger

__all__ = ["RoutedMethods"]


class RoutedMethods:
    """The methods of ``owner``'s class among ``names`` routed to the graphs."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        self.owner = owner
        self.names = tuple(name for name in names if callable(getattr(type(owner), name, None)))
        self._state = _Scopes()

    def route(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        """Route each method, called through the wrapper, to ``serve(name, *args, **kwargs)``
        (through ``changes``, so that unwrapping takes the routes back)."""
        for name in self.names:
            routed = types.MethodType(self._routed(name, serve), self.owner)
            changes.set_attribute(self.owner, name, routed, f"{name} routed to the graphs")

    def _routed(self, name: str, serve: Callable[..., Any]) -> Callable[..., Any]:
        original = getattr(type(self.owner), name)

        def routed(owner: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.routing():
                return serve(name, *args, **kwargs)
            return original(owner, *args, **kwargs)

        routed.__name__, routed.__doc__ = name, original.__doc__
        return routed

    def routing(self) -> bool:
        """Whether a routed method called now goes to the graphs: called through the wrapper,
        not from inside a running region. Inside a region the second flag is not read, so a
        compiled region is not guarded on it: a region is the same whichever thread runs it
        and whether its call came through the wrapper (a background compile's does not)."""
        return not self._state.inside and self._state.through

    def through_wrapper(self) -> _Flag:
        """The scope of a call through the wrapper: the routed methods reach the graphs."""
        return _Flag(self._state, "through")

    def running(self) -> _Flag:
        """The scope of a region running (eagerly, or being captured): the routed methods
        run the class's own."""
        return _Flag(self._state, "inside")

    def run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The class's own method ``name`` on the call's arguments: what a graph captures."""
        with self.running():
            return getattr(type(self.owner), name)(self.owner, *args, **kwargs)

    @staticmethod
    def method_of(call: CallInputs, default: str = "forward") -> str:
        """The method a routed call was made through (its first argument), else
        ``default``."""
        first: Hashable = call.argument("method", position=0)
        return first if isinstance(first, str) else default


class _Scopes(threading.local):
    """A thread's scope flags, both set false in each thread before its first use (a
    ``threading.local`` runs ``__init__`` per thread): a compiled region that enters a scope is
    then guarded on the flag's value, which is the same at each call, not on whether the thread
    has set the flag yet (which would compile the region again on its second call)."""

    def __init__(self) -> None:
        self.through = False
        self.inside = False


class _Flag:
    """Sets a thread's flag ``name`` for the duration of a ``with`` block (a class rather than
    a generator: it is entered around every call through the wrapper)."""

    __slots__ = ("_name", "_outer", "_state")

    def __init__(self, state: _Scopes, name: str) -> None:
        self._state, self._name = state, name
        self._outer = False

    def __enter__(self) -> None:
        self._outer = getattr(self._state, self._name)
        setattr(self._state, self._name, True)

    def __exit__(self, *_: object) -> None:
        setattr(self._state, self._name, self._outer)
