"""Guards that keep captured graphs honest: model changes, hooks, held outputs, addresses.

A graph bakes in the addresses of everything it reads. These guards notice, cheaply and on the
calling thread, when that no longer holds:

- :class:`ParameterWatch`: the model's parameters or buffers were moved, re-allocated or
  replaced (``model.to(...)``, ``.half()``, ``load_state_dict(..., assign=True)``, a submodule
  swapped). In-place updates (``p.copy_(...)``, an optimizer step) keep their addresses and
  are not changes. It reads addresses only after a move or a registration was noticed
  (:class:`NoticeMoves`), so a call pays two counter comparisons.
- :class:`HookWatch`: forward hooks or pre-hooks were registered or removed on the model's
  modules, or globally, since a baseline (:class:`HookFingerprint`). A replay runs kernels,
  never Python, so a hook that was not there at capture would be skipped by every replay.
- :class:`HeldOutputs`: with ``static_output=True``, an output returned by an earlier replay
  is still referenced when the next replay of the same graph is about to overwrite it.
- :func:`addresses`: the data pointers of a set of tensors, recorded at capture and compared at
  replay in debug mode.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .ledger import Change, SetAttribute

__all__ = [
    "GLOBAL_HOOKS",
    "HeldOutputs",
    "HookFingerprint",
    "HookWatch",
    "NoticeMoves",
    "ParameterWatch",
    "addresses",
]

_registrations = 0


def _count_registration(*_: object) -> None:
    global _registrations
    _registrations += 1


# Every assignment of a submodule, parameter or buffer anywhere bumps one counter, so that a
# watch re-reads its model's tensors only when some module's structure changed.
nn.modules.module.register_module_module_registration_hook(_count_registration)
nn.modules.module.register_module_parameter_registration_hook(_count_registration)
nn.modules.module.register_module_buffer_registration_hook(_count_registration)


def addresses(tensors: Iterable[object]) -> tuple[int, ...]:
    """The data pointers of the tensors among ``tensors`` (other objects are skipped).

    A distributed tensor (a tensor-parallel shard's ``DTensor``) counts by its local shard.
    """
    return tuple(
        (t.to_local() if hasattr(t, "to_local") else t).data_ptr()
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


_moves = 0


def _count_move() -> None:
    global _moves
    _moves += 1


class NoticeMoves(Change):
    """Makes every module of a tree count its ``_apply`` calls, for :class:`ParameterWatch`.

    ``nn.Module._apply`` is what ``to()``, ``cuda()``, ``half()``, ``float()`` and their kin
    run on each module to move or convert its parameters and buffers. While applied, each
    module's ``_apply`` is its own followed by a bump of one process-wide counter; undone, the
    modules are as they were. A module added to the tree later is not instrumented, but a move
    made through any ancestor still is counted.
    """

    def __init__(self, module: nn.Module) -> None:
        self.target = module
        self.what = "moves and conversions (to, cuda, half) counted for the graphs' guard"
        self._parts: list[SetAttribute] = []

    def apply(self) -> None:
        self._parts = [
            SetAttribute(submodule, "_apply", _counting(submodule._apply), self.what)
            for submodule in self.target.modules()
        ]
        for part in self._parts:
            part.apply()

    def undo(self) -> None:
        for part in reversed(self._parts):
            part.undo()
        self._parts = []


def _counting(apply: Callable[..., Any]) -> Callable[..., Any]:
    """``apply`` (a module's bound ``_apply``), counting each call once it returns."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return apply(*args, **kwargs)
        finally:
            _count_move()

    return counted


class ParameterWatch:
    """Tells whether a module's parameters and buffers still live where they did.

    A check compares two process-wide counters: the registrations of submodules, parameters
    and buffers (``load_state_dict(..., assign=True)``, a submodule swapped) and the moves
    :class:`NoticeMoves` counts (``to()``, ``half()``...). Only when one moved are the
    addresses read again (about 20 µs for 400 tensors), and the module tree walked again after
    a registration. Not noticed: a parameter's ``data`` set by hand (``p.data = t``) or an entry
    of ``_parameters`` written directly; ``debug=True`` checks every address at each replay.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._read_structure()
        self._moves_seen = _moves
        self._addresses = addresses(self._tensors)

    def _read_structure(self) -> None:
        self._seen = _registrations
        self._tensors = list(itertools.chain(self._module.parameters(), self._module.buffers()))

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers, as of the last check."""
        return self._tensors

    def changed(self) -> bool:
        """Whether any parameter or buffer moved since the last call; then re-arms."""
        if self._seen == _registrations and self._moves_seen == _moves:
            return False
        if self._seen != _registrations:
            self._read_structure()
        self._moves_seen = _moves
        now = addresses(self._tensors)
        if now == self._addresses:
            return False
        self._addresses = now
        return True


GLOBAL_HOOKS = "<global>"
"""The place of PyTorch's global forward hooks in a :class:`HookFingerprint`: those of
``torch.nn.modules.module.register_module_forward_hook`` and its pre-hook twin, which run on
every module."""

_Hooks = tuple[tuple[Callable[..., Any], ...], tuple[Callable[..., Any], ...]]
"""The forward pre-hooks and the forward hooks of one place, in the order they run."""

_NO_HOOKS: _Hooks = ((), ())

_HookTables = tuple[str, Mapping[int, Callable[..., Any]], Mapping[int, Callable[..., Any]]]
"""A place (a module's path, or :data:`GLOBAL_HOOKS`), its pre-hook table and its hook table."""


def _hook_tables(module: nn.Module) -> list[_HookTables]:
    """The forward hook tables of ``module``, of each submodule, then the global ones."""
    tables: list[_HookTables] = [
        (path, submodule._forward_pre_hooks, submodule._forward_hooks)
        for path, submodule in module.named_modules()
    ]
    torch_modules = nn.modules.module
    tables.append(
        (
            GLOBAL_HOOKS,
            torch_modules._global_forward_pre_hooks,
            torch_modules._global_forward_hooks,
        )
    )
    return tables


@dataclass(frozen=True)
class HookFingerprint:
    """The forward pre-hooks and forward hooks that run on a module tree, by the hooks.

    Equal fingerprints mean the same callables, in the same order, at the same places (module
    paths, and the global hooks); hooks that take keyword arguments are in the same tables.
    Removing a hook and registering the same function again gives an equal fingerprint: hooks
    compare as Python compares callables (functions by identity, bound methods by instance and
    function). The fingerprint holds the hooks themselves, so no identity it compares is ever
    reused. Backward and state-dict hooks are not part of it: graphs serve inference calls.
    """

    places: tuple[tuple[str, _Hooks], ...]
    """``(place, (pre-hooks, hooks))`` for each place with any forward hook, sorted by place:
    module paths (the root's is ``""``) and :data:`GLOBAL_HOOKS`."""

    @classmethod
    def read(cls, module: nn.Module) -> HookFingerprint:
        """The hooks on ``module``, on its submodules, and the global ones, as they are now."""
        return cls._of(_hook_tables(module))

    @classmethod
    def _of(cls, tables: Iterable[_HookTables]) -> HookFingerprint:
        return cls._sorted(
            {place: (tuple(pre.values()), tuple(post.values())) for place, pre, post in tables}
        )

    @classmethod
    def _sorted(cls, places: Mapping[str, _Hooks]) -> HookFingerprint:
        held = [(place, hooks) for place, hooks in places.items() if hooks[0] or hooks[1]]
        return cls(tuple(sorted(held, key=lambda item: item[0])))

    def differences(self, other: HookFingerprint) -> tuple[str, ...]:
        """The places whose hooks differ in ``other``, sorted; empty when the fingerprints are
        equal."""
        mine, theirs = dict(self.places), dict(other.places)
        return tuple(sorted(p for p in {*mine, *theirs} if mine.get(p) != theirs.get(p)))

    def adopted(self, before: HookFingerprint, after: HookFingerprint) -> HookFingerprint:
        """This fingerprint changed as the hooks changed from ``before`` to ``after``: at each
        place, the hooks removed in between taken out, those registered in between added last.
        """
        mine, old, new = dict(self.places), dict(before.places), dict(after.places)
        for place in before.differences(after):
            kept = mine.get(place, _NO_HOOKS)
            was, now = old.get(place, _NO_HOOKS), new.get(place, _NO_HOOKS)
            mine[place] = (_changed(kept[0], was[0], now[0]), _changed(kept[1], was[1], now[1]))
        return HookFingerprint._sorted(mine)


def _changed(
    kept: tuple[Callable[..., Any], ...],
    was: tuple[Callable[..., Any], ...],
    now: tuple[Callable[..., Any], ...],
) -> tuple[Callable[..., Any], ...]:
    """``kept`` without the hooks that went from ``was`` to ``now``, then those that came."""
    return (
        *(hook for hook in kept if hook in now or hook not in was),
        *(hook for hook in now if hook not in was),
    )


class HookWatch:
    """Tells whether the forward hooks on a module tree differ from a baseline, cheaply.

    A check compares two global counters (PyTorch's ``RemovableHandle.next_id``, bumped by
    every hook registration anywhere, and the count of submodule, parameter and buffer
    registrations :class:`ParameterWatch` uses) and the size of each hook table that held
    hooks at the last reading (a removal shrinks one): about 0.1 µs when none moved, 0.3 µs
    with hooks in place. Only when one moved is the tree walked and its
    :class:`HookFingerprint` read again (about 0.2 ms for 200 modules). Not noticed: a hook
    written into an empty hook table directly, without a handle, and a module holding hooks
    put into the tree by writing ``_modules`` directly.
    """

    def __init__(self, module: nn.Module, baseline: HookFingerprint | None = None) -> None:
        self._module = module
        self._lock = threading.Lock()
        """Held while the reading, the baseline and the differences change together."""
        self._read()
        self._baseline = self._now if baseline is None else baseline
        self._differences = self._baseline.differences(self._now)

    @property
    def baseline(self) -> HookFingerprint:
        """The hooks the module is expected to have."""
        return self._baseline

    def accept(self, baseline: HookFingerprint | None = None) -> bool:
        """Take ``baseline`` (default: the hooks as they are now) as the expected hooks; return
        whether it differs from the previous baseline."""
        with self._lock:
            self._read()
            previous, self._baseline = self._baseline, self._now if baseline is None else baseline
            self._differences = self._baseline.differences(self._now)
        return self._baseline != previous

    def differences(self) -> tuple[str, ...]:
        """Where the hooks differ from the baseline now (:meth:`HookFingerprint.differences`);
        empty when they do not."""
        if (
            RemovableHandle.next_id != self._handles_seen
            or _registrations != self._registrations_seen
            or (self._tables and tuple(map(len, self._tables)) != self._sizes)
        ):
            with self._lock:
                self._read()
                self._differences = self._baseline.differences(self._now)
        return self._differences

    @contextlib.contextmanager
    def adopting(self) -> Iterator[None]:
        """Take the hooks registered or removed while the block runs into the baseline.

        For the module's own runs: a model may install hooks on itself as it runs (transformers
        installs its output-capturing hooks on the first call that asks for hidden states),
        and those are part of what its graphs capture. Hooks other threads change meanwhile
        are taken too.
        """
        self.differences()
        before = self._now
        try:
            yield
        finally:
            self.differences()
            if self._now != before:
                with self._lock:
                    self._baseline = self._baseline.adopted(before, self._now)
                    self._differences = self._baseline.differences(self._now)

    def _read(self) -> None:
        self._handles_seen = RemovableHandle.next_id
        self._registrations_seen = _registrations
        tables = _hook_tables(self._module)
        self._now = HookFingerprint._of(tables)
        self._tables = tuple(table for _, *pair in tables for table in pair if table)
        """The hook tables that held hooks at this reading: a removal shrinks one."""
        self._sizes = tuple(map(len, self._tables))


class HeldOutputs:
    """Weak references to the outputs a graph returned, to tell whether any is still held."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[torch.Tensor]] = []

    def track(self, tensors: Iterable[object]) -> None:
        """Remember ``tensors`` (the views handed to the caller) until the next replay."""
        self._refs = [weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor)]

    def any_alive(self) -> bool:
        """Whether the caller still references an output of the previous replay."""
        return any(ref() is not None for ref in self._refs)
