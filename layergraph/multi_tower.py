"""Towers inside a model no adapter knows, or several towers in one model: each served in
place by its own adapter's plan, under one wrapper.

Video-LLaVA holds an image tower and a video tower; a retrieval model (ColPali, ColQwen2) or
a robot policy holds a VLM whose tower an adapter serves. ``wrap(model)`` (``adapter="auto"``)
finds the parts of the model, four levels down at most, that dedicated adapters recognise
(:func:`find_towers`); in a model no dedicated adapter recognises itself, each of them is
wrapped in place (its forward routed to its graphs, as a tower
inside a VLM is) and a :class:`GraphedTowers` is returned: calls run the model's own
forward, which reaches every tower's graphs, and the towers' graphs share one memory pool.
``graphed.towers`` holds each tower's wrapper (its stats, keys, changes and speed options) by
path; ``unwrap()`` undoes every tower's changes.

What it does not do: know any model. A part is a tower when exactly one recognised part, itself
or one below it, holds no recognised part of its own; the shallowest such part is taken, so
a tower that holds its own transformer (``CLIPVisionModel``) is wrapped whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from torch import nn

from .serving.pool import PoolShare
from .stats import GraphStats

__all__ = [
    "SHARED_POOLS",
    "TOWER_DEPTH",
    "GraphedTowers",
    "TowerWrapper",
    "find_towers",
    "options_for",
    "wrap_towers",
]

TOWER_DEPTH = 4
"""How many levels below the model a tower is looked for (``model.vlm.model.vision_tower``)."""


class TowerWrapper(Protocol):
    """What a wrapper of several towers asks of each tower's wrapper
    (:class:`~layergraph.module.GraphedModule` is one)."""

    unwrapped: bool

    @property
    def stats(self) -> GraphStats: ...

    @property
    def changes(self) -> list[str]: ...

    def original(self) -> contextlib.AbstractContextManager[nn.Module]: ...

    def release(self) -> None: ...

    def unwrap(self) -> nn.Module: ...

    def finish_compiling(self, timeout: float | None = None) -> bool: ...


def find_towers(
    model: nn.Module,
    recognize: Callable[[nn.Module], str | None],
    inside_any_model: Callable[[str], bool] = lambda adapter: True,
) -> dict[str, str]:
    """The towers of ``model`` by path, each with the dedicated adapter ``recognize`` names for
    it: the shallowest parts (up to :data:`TOWER_DEPTH` levels down, not the model itself, not
    inside a module list) under which exactly one recognised part holds no recognised part.
    A tower whose adapter may not serve it inside a model it does not know
    (``inside_any_model(adapter)`` false: a VLM it does not know may call the tower its own
    way) is left out unless a part above or below it is recognised by the same adapter (the
    adapter knows the model that holds the tower)."""
    recognised: dict[str, str] = {}
    for path, part in model.named_modules():
        names = path.split(".")
        if not path or len(names) > TOWER_DEPTH or any(name.isdigit() for name in names):
            continue
        if isinstance(part, (nn.ModuleList, nn.ModuleDict)):
            continue
        adapter = recognize(part)
        if adapter is not None:
            recognised[path] = adapter

    def below(path: str) -> list[str]:
        return [other for other in recognised if other.startswith(path + ".")]

    leaves = {path for path in recognised if not below(path)}
    towers: dict[str, str] = {}
    for path in sorted(recognised, key=lambda found: found.count(".")):
        if any(path.startswith(tower + ".") for tower in towers):
            continue
        if len(leaves & {path, *below(path)}) == 1:
            towers[path] = recognised[path]
    return {
        path: adapter
        for path, adapter in towers.items()
        if inside_any_model(adapter)
        or any(
            (path.startswith(other + ".") or other.startswith(path + "."))
            and recognised[other] == adapter
            for other in recognised
        )
    }


def options_for(
    adapter_classes: Mapping[str, type], options: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each tower's share of the adapter options given to ``wrap``: an option goes to every
    tower whose adapter's constructor takes it. Raises ``TypeError`` naming an option none of
    them takes."""
    shares: dict[str, dict[str, Any]] = {path: {} for path in adapter_classes}
    for option, value in options.items():
        takers = [
            path
            for path, adapter in adapter_classes.items()
            if option in inspect.signature(adapter).parameters
        ]
        if not takers:
            names = ", ".join(sorted({cls.__name__ for cls in adapter_classes.values()}))
            raise TypeError(f"option {option!r} is taken by none of the towers' adapters ({names})")
        for path in takers:
            shares[path][option] = value
    return shares


SHARED_POOLS: contextvars.ContextVar[PoolShare | None] = contextvars.ContextVar(
    "layergraph_shared_pools", default=None
)
"""The pool share of the wrapper of several towers being made: each tower's runner joins it,
and ``wrap`` looks for no towers inside a tower."""


def wrap_towers(
    model: nn.Module,
    towers: Mapping[str, str],
    adapter_classes: Mapping[str, type],
    adapter_options: Mapping[str, Any],
    pools: PoolShare,
    wrap_tower: Callable[[nn.Module, str, dict[str, Any]], TowerWrapper],
) -> GraphedTowers:
    """Wrap each of ``model``'s ``towers`` (path: adapter name) in place with
    ``wrap_tower(part, adapter name, its options)``, their graphs in ``pools``, each given the
    adapter options its adapter takes (:func:`options_for`); undo them all if one fails."""
    shares = options_for(adapter_classes, adapter_options)
    wrapped: dict[str, TowerWrapper] = {}
    token = SHARED_POOLS.set(pools)
    try:
        for path, name in towers.items():
            wrapped[path] = wrap_tower(model.get_submodule(path), name, shares[path])
    except BaseException:
        for tower in reversed(wrapped.values()):
            tower.unwrap()
        raise
    finally:
        SHARED_POOLS.reset(token)
    return GraphedTowers(model, wrapped)


class GraphedTowers(nn.Module):
    """A model whose towers each replay their own graphs, in place; the model is called as it
    is (its own forward, ``generate``, ``get_audio_features``...).

    Attributes the wrapper does not define are looked up on the model. The model is a
    submodule named ``module``.
    """

    def __init__(self, model: nn.Module, towers: Mapping[str, TowerWrapper]) -> None:
        super().__init__()
        self.module = model
        self._towers = dict(towers)
        self.unwrapped = False

    @property
    def towers(self) -> dict[str, TowerWrapper]:
        """Each tower's wrapper, by its path in the model."""
        return dict(self._towers)

    @property
    def stats(self) -> dict[str, GraphStats]:
        """Each tower's statistics, by its path (its graphs, replays, eager calls...)."""
        return {path: tower.stats for path, tower in self._towers.items()}

    @property
    def changes(self) -> list[str]:
        """What wrapping changed in the model, each tower's changes under its path."""
        return [
            path + change.removeprefix("(model)")
            if change.startswith("(model)")
            else f"{path}.{change}"
            for path, tower in self._towers.items()
            for change in tower.changes
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_wrapped()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def original(self) -> Iterator[nn.Module]:
        """The model as it was before wrapping, for the duration of a ``with`` block: every
        tower's changes undone, and made again afterwards."""
        self._check_wrapped()
        with contextlib.ExitStack() as stack:
            for tower in self._towers.values():
                stack.enter_context(tower.original())
            yield self.module

    def finish_compiling(self, timeout: float | None = None) -> bool:
        """Wait for every tower's background compile, each up to ``timeout`` seconds
        (:meth:`GraphedModule.finish_compiling <layergraph.module.GraphedModule.finish_compiling>`);
        whether none runs now."""
        return all([tower.finish_compiling(timeout) for tower in self._towers.values()])

    def release(self) -> None:
        """Drop every tower's graphs; later calls capture again."""
        for tower in self._towers.values():
            tower.release()

    def unwrap(self) -> nn.Module:
        """Undo every tower's changes (the last tower wrapped first) and return the model."""
        if not self.unwrapped:
            for tower in reversed(list(self._towers.values())):
                tower.unwrap()
            self.unwrapped = True
        return self.module

    def _check_wrapped(self) -> None:
        if self.unwrapped:
            raise RuntimeError(
                f"this wrapper of a {type(self.module).__name__} was unwrapped; call the model "
                f"unwrap() returned, or wrap it again"
            )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        value = getattr(self._modules["module"], name)
        if inspect.ismethod(value) and value.__self__ is self._modules["module"]:
            self._check_wrapped()
        return value
