"""The ledger of changes a wrapper makes to the user's model, and how each is undone.

Wrapping may change the model it is given: a region's forward routed to the graphs, a module's
forward rewritten, a forward hook added, a layer compiled, q/k/v weights moved into one fused
tensor, the layer list cut short for one call. Every such change is a :class:`Change`, an
``apply`` and an ``undo`` that takes it back exactly, made through the wrapped module's
:class:`ChangeLedger`. Nothing changes the model any other way, so one object knows
everything that was done and undoes it, in reverse order, on ``unwrap()``:

- the same ``Parameter`` and buffer objects, holding the values they hold now;
- the same classes;
- no instance attribute, hook or submodule left behind or missing.

A module the ledger changed pickles and copies as the module ``unwrap()`` would give back
(:class:`PickledUnchanged`): ``torch.save(model)``, ``pickle`` and ``copy.deepcopy(model)``
work while it is wrapped and give an ordinary model.

``GraphedModule.original()`` suspends the ledger (undo everything, then apply it all again)
for comparisons against the unmodified model.

Plans make their changes in :meth:`~layergraph.CapturePlan.change_model`, with the helpers
below (:meth:`ChangeLedger.set_forward`, :meth:`ChangeLedger.add_forward_hook`...) or with a
:class:`Change` of their own (``layergraph_adapters.kit.fused_qkv.FusedQKV`` is one). A change
must be re-appliable after its undo: ``original()`` relies on it.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "AddForwardHook",
    "Change",
    "ChangeLedger",
    "PickledUnchanged",
    "ReplaceSubmodule",
    "SetAttribute",
    "SwapClass",
    "UndoError",
]


class Change(ABC):
    """One change to the model: :meth:`apply` makes it, :meth:`undo` takes it back exactly.

    ``apply`` is called once per application and ``undo`` once after each ``apply``; after
    ``undo`` the change may be applied again. :attr:`target` and :attr:`what` describe it
    in :attr:`ChangeLedger.descriptions`.
    """

    target: object
    """The object changed (a module, usually)."""
    what: str
    """What the change does, in a few words (``"forward routed to the graphs"``)."""

    @abstractmethod
    def apply(self) -> None:
        """Make the change."""

    @abstractmethod
    def undo(self) -> None:
        """Take the change back, leaving the target as it was before :meth:`apply`."""


_ABSENT = object()


class SetAttribute(Change):
    """Sets an instance attribute (``forward``, ``_compiled_call_impl``); undo restores the old
    value, or removes the attribute if the instance had none of its own.

    Not for parameters, buffers or submodules of a module (those are not plain instance
    attributes): use :class:`ReplaceSubmodule` for a submodule.
    """

    def __init__(self, target: object, name: str, value: Any, what: str) -> None:
        if isinstance(target, nn.Module) and (
            name in target._parameters or name in target._buffers or name in target._modules
        ):
            raise ValueError(
                f"{name!r} is a parameter, buffer or submodule of {type(target).__name__}, "
                f"not a plain attribute"
            )
        self.target, self.name, self.value, self.what = target, name, value, what
        self._old: Any = _ABSENT

    def apply(self) -> None:
        self._old = vars(self.target).get(self.name, _ABSENT)
        vars(self.target)[self.name] = self.value

    def undo(self) -> None:
        if self._old is _ABSENT:
            vars(self.target).pop(self.name, None)
        else:
            vars(self.target)[self.name] = self._old
        self._old = _ABSENT


class SwapClass(Change):
    """Changes an object's class to a subclass of it; undo changes it back."""

    def __init__(self, target: object, cls: type, what: str) -> None:
        if not issubclass(cls, type(target)):
            raise TypeError(f"{cls.__name__} is not a subclass of {type(target).__name__}")
        self.target, self.cls, self.what = target, cls, what
        self._old: type = type(target)

    def apply(self) -> None:
        self._old = type(self.target)
        self.target.__class__ = self.cls

    def undo(self) -> None:
        self.target.__class__ = self._old


class AddForwardHook(Change):
    """Registers a forward hook on a module; undo removes it."""

    def __init__(self, target: nn.Module, hook: Callable[..., Any], what: str) -> None:
        self.target, self.hook, self.what = target, hook, what
        self._handle: RemovableHandle | None = None

    def apply(self) -> None:
        self._handle = self.target.register_forward_hook(self.hook)

    def undo(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class ReplaceSubmodule(Change):
    """Puts ``module`` in place of the submodule ``name`` of ``target``; undo puts the old one
    back."""

    def __init__(self, target: nn.Module, name: str, module: nn.Module, what: str) -> None:
        if name not in target._modules:
            raise ValueError(f"{type(target).__name__} has no submodule {name!r}")
        self.target, self.name, self.module, self.what = target, name, module, what
        self._old: nn.Module | None = None

    def apply(self) -> None:
        self._old = self.target._modules[self.name]
        self.target._modules[self.name] = self.module

    def undo(self) -> None:
        self.target._modules[self.name] = self._old
        self._old = None


class PickledUnchanged:
    """A changed module's ``__reduce_ex__`` while it is changed: the reduction of a copy of the
    module made with every change of the ledger undone, sharing its parameters and buffers.

    So ``pickle``, ``torch.save`` and ``copy.deepcopy`` of the module, or of a model holding
    it, give the module as ``unwrap()`` would: its own classes and forwards, no hook or
    attribute of layergraph's. The ledger is suspended while the copy is made (as
    ``GraphedModule.original()`` does), so a call served at that moment on another thread runs
    unchanged.
    """

    def __init__(self, ledger: ChangeLedger, target: nn.Module) -> None:
        self._ledger = ledger
        self._target = target

    def __call__(self, protocol: int) -> Any:
        target = self._target
        with self._ledger.suspended():
            shared = {id(t): t for t in (*target.parameters(), *target.buffers())}
            unchanged = copy.deepcopy(target, shared)
        return unchanged.__reduce_ex__(protocol)


class UndoError(RuntimeError):
    """One or more changes could not be undone; the others were."""


class ChangeLedger:
    """Every change made to one wrapped model, in the order made.

    Invariant: :attr:`_applied` holds exactly the changes applied now, oldest first; a change
    enters it only once its ``apply`` returned and leaves it once its ``undo`` ran. Undoing
    goes newest first, so each change sees the model as it left it.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._applied: list[Change] = []
        self._marks: list[SetAttribute] = []
        """The ``__reduce_ex__`` of each module changed (:class:`PickledUnchanged`): kept
        apart from the changes, taken back after them by :meth:`undo_all`."""
        self._lock = threading.RLock()

    # ---- making changes ----------------------------------------------------------------------

    def apply(self, change: Change) -> Change:
        """Apply ``change`` and record it; returns it. A module changed for the first time is
        first made to pickle and copy as it is unchanged (:class:`PickledUnchanged`)."""
        with self._lock:
            target = change.target
            if isinstance(target, nn.Module) and not isinstance(
                vars(target).get("__reduce_ex__"), PickledUnchanged
            ):
                mark = SetAttribute(
                    target,
                    "__reduce_ex__",
                    PickledUnchanged(self, target),
                    "pickled and copied as it is unwrapped",
                )
                mark.apply()
                self._marks.append(mark)
            change.apply()
            self._applied.append(change)
        return change

    def set_forward(self, module: nn.Module, forward: Callable[..., Any], what: str) -> Change:
        """Route ``module``'s calls to ``forward`` (an instance ``forward``)."""
        return self.apply(SetAttribute(module, "forward", forward, what))

    def set_attribute(self, target: object, name: str, value: Any, what: str) -> Change:
        """Set the instance attribute ``name`` of ``target`` (see :class:`SetAttribute`)."""
        return self.apply(SetAttribute(target, name, value, what))

    def swap_class(self, target: object, cls: type, what: str) -> Change:
        """Change ``target``'s class to ``cls``, a subclass of its own."""
        return self.apply(SwapClass(target, cls, what))

    def add_forward_hook(self, module: nn.Module, hook: Callable[..., Any], what: str) -> Change:
        """Register ``hook`` as a forward hook of ``module``."""
        return self.apply(AddForwardHook(module, hook, what))

    @contextlib.contextmanager
    def temporarily(self, change: Change) -> Iterator[None]:
        """Apply ``change`` for the duration of a ``with`` block (one call, say)."""
        self.apply(change)
        try:
            yield
        finally:
            self._undo(change)

    # ---- undoing -----------------------------------------------------------------------------

    def undo_all(self) -> None:
        """Undo every change, newest first. An undo that raises does not stop the others;
        :class:`UndoError` then names what could not be undone."""
        with self._lock:
            failures = []
            for change in reversed(list(self._applied)):
                try:
                    self._undo(change)
                except Exception as error:
                    failures.append(f"{self._describe(change)}: {type(error).__name__}: {error}")
            marks, self._marks = self._marks, []
            for mark in reversed(marks):
                mark.undo()
            if failures:
                raise UndoError("could not undo " + "; ".join(failures))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Undo every change for the duration of a ``with`` block, then apply them again."""
        with self._lock:
            changes = list(self._applied)
            self.undo_all()
            try:
                yield
            finally:
                for change in changes:
                    self.apply(change)

    def _undo(self, change: Change) -> None:
        with self._lock:
            self._applied.remove(change)
            change.undo()

    # ---- what was done -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._applied)

    def __iter__(self) -> Iterator[Change]:
        return iter(list(self._applied))

    @property
    def descriptions(self) -> list[str]:
        """Each change applied now, oldest first, as ``"path.to.module: what it does"``."""
        return [self._describe(change) for change in self]

    def _describe(self, change: Change) -> str:
        paths = {id(module): name for name, module in self._model.named_modules()}
        path = paths.get(id(change.target))
        if path is None:
            path = type(change.target).__name__
        return f"{path or '(model)'}: {change.what}"
