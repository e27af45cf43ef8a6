"""The output of a graph that stopped early, completed by the whole model when read.

A feature graph (``feature_layers``) computes the hidden states a VLM reads and stops there: it
has no ``last_hidden_state``, no ``pooler_output``, and no hidden states past the deepest one
needed. Returning ``None`` for those would be a silent wrong answer to a caller who reads them.
:func:`with_rest_on_demand` returns the output as a subclass of its own class that, the first
time one of those is read, runs the model's whole forward (eagerly) and answers from it;
reading only what the graph computed costs nothing more. :func:`computed_later` makes that
forward: on a copy of the call's inputs taken at the call, so that a caller who refills its
pixel buffer before reading gets the answer of the inputs it called with, and counted in the
wrapper's ``stats`` when it runs.

Covered: attribute access (``out.last_hidden_state``), string and integer indexing, iteration
over ``hidden_states``, ``to_tuple()``, and the mapping's ``keys()``, ``values()``,
``items()``, iteration, ``len()`` and ``in``, which list the keys the whole model's output has:
learnt once per set of fields from a run of the whole forward on fake tensors (shapes only, no
compute), or, where the forward cannot run so, from the whole output itself. A transformers
``ModelOutput`` (a dataclass and an ordered dict) is what it is for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["ON_DEMAND_REASON", "computed_later", "feature_indices", "with_rest_on_demand"]

ON_DEMAND_REASON = "a field the feature graphs left out was read (the whole tower ran for it)"
"""The reason ``stats.eager_calls`` counts a forward :func:`computed_later` ran under."""

_REST = "_layergraph_rest"


def feature_indices(wanted: int | Sequence[int], depth: int) -> tuple[int, ...]:
    """The indices into a tower's ``hidden_states`` (0: embeddings, ``i``: after layer ``i``
    of ``depth``) that ``wanted`` names (an index or a list of them, negative ones from the
    end), sorted and without repeats; a ``ValueError`` names an index out of range."""
    indices = [wanted] if isinstance(wanted, int) else list(wanted)
    count = depth + 1
    if not indices or any(not -count <= i < count for i in indices):
        raise ValueError(
            f"feature_layers {wanted!r}: hidden_states has {count} entries (embeddings and "
            f"{depth} layers), so indices must lie in [{-count}, {count - 1}]"
        )
    return tuple(sorted({i % count for i in indices}))


class _Rest:
    """The whole model's output for the same inputs, computed once, on first need.

    Shared by an output and its hidden states, and holding neither: a reference cycle between
    them would keep a graph's static outputs alive until the garbage collector runs, and
    ``static_output=True`` would warn of outputs still held that the caller has dropped.
    """

    def __init__(
        self,
        compute: Callable[[], Any],
        pattern: tuple[str, ...],
        known: dict[tuple[str, ...], tuple[str, ...]],
    ) -> None:
        self._compute: Callable[[], Any] | None = compute
        self._whole: Any = None
        self.pattern = pattern
        """The fields the graph's output had, which the keys of the whole are known by."""
        self.known = known
        """The whole output's keys by the graph output's fields, learnt once per pattern."""

    def keys(self) -> tuple[str, ...]:
        """The whole model's output's keys: learnt for this pattern, else computed."""
        keys = self.known.get(self.pattern)
        if keys is None:
            fields = self._compute.fields() if isinstance(self._compute, _Later) else None
            keys = tuple(self.whole().keys()) if fields is None else fields
            self.known[self.pattern] = keys
        return keys

    def whole(self) -> Any:
        if self._compute is not None:
            self._whole, self._compute = self._compute(), None
        return self._whole


def computed_later(
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    count: Callable[[str, int | None], None],
) -> _Later:
    """``forward(*args, **kwargs)`` to run later, on copies of the tensors among ``args`` and
    ``kwargs`` taken now; ``count(reason, size)`` is called when it runs (``size``: the first
    tensor's length)."""
    return _Later(forward, *pytree.tree_map(_copied, (args, kwargs)), count)


class _Later:
    """A forward and the inputs it will run on: run for its values (counted), or on fake
    tensors for the fields of its output alone (nothing computed, nothing counted)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        count: Callable[[str, int | None], None],
    ) -> None:
        self._forward, self._args, self._kwargs, self._count = forward, args, kwargs, count
        self._inference = torch.is_inference_mode_enabled()
        self._grad = torch.is_grad_enabled()
        """The call's modes, which the run keeps whenever it happens (a field read after
        the caller's ``torch.inference_mode()`` block ended)."""

    def __call__(self) -> Any:
        tensors = [
            leaf
            for leaf in pytree.tree_leaves((self._args, self._kwargs))
            if isinstance(leaf, torch.Tensor)
        ]
        self._count(ON_DEMAND_REASON, len(tensors[0]) if tensors and tensors[0].dim() else None)
        with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad):
            return self._forward(*self._args, **self._kwargs)

    def fields(self) -> tuple[str, ...] | None:
        """The keys of the forward's output, from a run on fake tensors (shapes only); ``None``
        where the forward cannot run so (it reads a value, or an operator has no fake
        kernel)."""
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                args, kwargs = pytree.tree_map(
                    lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                    (self._args, self._kwargs),
                )
                output = self._forward(*args, **kwargs)
        except Exception:  # any failure means: learn the fields by running the forward
            return None
        return tuple(output.keys()) if hasattr(output, "keys") else None


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def with_rest_on_demand(
    output: Any,
    compute: Callable[[], Any],
    known: dict[tuple[str, ...], tuple[str, ...]] | None = None,
) -> Any:
    """``output`` whose ``None`` fields (and ``None`` hidden states) come from ``compute()``.

    ``compute`` runs at most once, the first time a missing value is read. ``output`` is
    returned as it is if it is not a dataclass output or misses nothing. ``known``: a dict a
    plan keeps across calls, where the keys of the whole output are learnt the first time
    they are needed for outputs with the same fields, so that listing them later (``keys()``,
    ``to_tuple()``, which a VLM's own output calls on its tower's) computes nothing.
    """
    if not dataclasses.is_dataclass(output):
        return output
    names = [field.name for field in dataclasses.fields(output)]
    hidden = getattr(output, "hidden_states", None)
    if all(getattr(output, name) is not None for name in names) and (
        hidden is None or all(h is not None for h in hidden)
    ):
        return output
    cls = _on_demand_class(type(output))
    pattern = tuple(name for name in names if getattr(output, name) is not None)
    rest = _Rest(compute, pattern, {} if known is None else known)
    values = {name: getattr(output, name) for name in names}
    if isinstance(hidden, tuple):
        values["hidden_states"] = _HiddenStates(hidden)
        values["hidden_states"].rest = rest
    completed = cls(**values)
    object.__setattr__(completed, _REST, rest)
    return completed


def _whole(output: Any) -> Any:
    """The whole model's output for the same inputs, computed on first need."""
    return object.__getattribute__(output, _REST).whole()


class _LazyFields(tuple):
    """An output's values as ``to_tuple()`` gives them, where a value the graph left out
    (``None``) is read from the whole model's output when it is read."""

    names: tuple[str, ...] = ()
    rest: _Rest | None = None

    def _value(self, index: int) -> Any:
        value = tuple.__getitem__(self, index)
        if value is None and self.rest is not None:
            return getattr(self.rest.whole(), self.names[index])
        return value

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self._value(i) for i in range(len(self))[index])
        return self._value(index)

    def __iter__(self) -> Iterator[Any]:
        return (self._value(i) for i in range(len(self)))


class _HiddenStates(tuple):
    """Hidden states with gaps that the whole model's hidden states fill when read."""

    rest: _Rest | None = None
    """The whole model's output for the same inputs, which fills the gaps."""

    def _filled(self) -> tuple[Any, ...]:
        """The graph's hidden states, each gap taken from the whole model's: the same values
        whether read by index, slice or iteration."""
        own = tuple(tuple.__iter__(self))
        if all(h is not None for h in own) or self.rest is None:
            return own
        whole = self.rest.whole().hidden_states
        return tuple(whole[index] if h is None else h for index, h in enumerate(own))

    def __getitem__(self, index: Any) -> Any:
        value = tuple.__getitem__(self, index)
        if isinstance(index, slice):
            return self._filled()[index] if any(v is None for v in value) else value
        return self._filled()[index] if value is None else value

    def __iter__(self) -> Iterator[Any]:
        return iter(self._filled())


@functools.cache
def _on_demand_class(base: type) -> type:
    """A subclass of the output class ``base`` that fills its ``None`` fields on reading."""
    names = frozenset(field.name for field in dataclasses.fields(base))

    def __getattribute__(self: Any, name: str) -> Any:
        value = base.__getattribute__(self, name)
        if value is None and name in names and _REST in base.__getattribute__(self, "__dict__"):
            return getattr(_whole(self), name)
        return value

    def __getitem__(self: Any, key: Any) -> Any:
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    order = [field.name for field in dataclasses.fields(base)]

    def listed(self: Any) -> list[str]:
        """The keys the whole model's output has, and any set on this one, in field order."""
        rest = object.__getattribute__(self, _REST)
        present = set(rest.keys()) | set(base.keys(self))
        return [name for name in order if name in present]

    def to_tuple(self: Any) -> tuple[Any, ...]:
        listed_names = listed(self)
        fields = _LazyFields(base.__getattribute__(self, name) for name in listed_names)
        fields.names = tuple(listed_names)
        fields.rest = object.__getattribute__(self, _REST)
        return fields

    def keys(self: Any) -> Any:
        return dict.fromkeys(listed(self)).keys()

    def values(self: Any) -> list[Any]:
        return [getattr(self, name) for name in listed(self)]

    def items(self: Any) -> list[tuple[str, Any]]:
        return [(name, getattr(self, name)) for name in listed(self)]

    def __iter__(self: Any) -> Iterator[str]:
        return iter(listed(self))

    def __len__(self: Any) -> int:
        return len(listed(self))

    def __contains__(self: Any, key: object) -> bool:
        return key in listed(self)

    return type(
        f"{base.__name__}WithRestOnDemand",
        (base,),
        {
            "__getattribute__": __getattribute__,
            "__getitem__": __getitem__,
            "to_tuple": to_tuple,
            "keys": keys,
            "values": values,
            "items": items,
            "__iter__": __iter__,
            "__len__": __len__,
            "__contains__": __contains__,
            "__module__": __name__,
            "__doc__": f"A {base.__name__} whose missing values the whole model computes.",
        },
    )
