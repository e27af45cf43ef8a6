"""A graph's output rebuilt from its leaves on every call: pytree's ``tree_unflatten``, prepared
once per output structure, so that a call pays for making its containers and no more.

pytree rebuilds a dataclass kept as an ordered mapping (a transformers ``ModelOutput``) through
its constructor, whose checks cost more than the rest of a replay's host work. A prepared
rebuild makes such an object as that constructor leaves it: every field an attribute, those
not ``None`` items as well, in the fields' order. Each structure's prepared rebuild is checked
once against pytree's own on the same leaves (types, items, attributes, the leaves
themselves); a structure it does not match, and any node of another type than tuples, lists,
dicts and such dataclasses, is rebuilt by pytree.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["Rebuilds"]

Builder = Callable[[Iterator[Any]], Any]


class Rebuilds:
    """Prepared rebuilds of the last ``kept`` output structures seen, each prepared the second
    time its structure (the same ``TreeSpec`` object) is seen: a structure made afresh on every
    call is rebuilt by pytree, as it would be anyway."""

    def __init__(self, kept: int = 16) -> None:
        self._kept = kept
        self._seen: OrderedDict[int, tuple[pytree.TreeSpec, Builder | None]] = OrderedDict()

    def __call__(self, leaves: Sequence[Any], spec: pytree.TreeSpec) -> Any:
        """``pytree.tree_unflatten(leaves, spec)``, the same object, made faster."""
        seen = self._seen.get(id(spec))
        if seen is None or seen[0] is not spec:
            if len(self._seen) >= self._kept:
                self._seen.popitem(last=False)
            self._seen[id(spec)] = (spec, None)
            return pytree.tree_unflatten(list(leaves), spec)
        builder = seen[1]
        if builder is None:
            builder = _prepared(spec, leaves)
            self._seen[id(spec)] = (spec, builder)
        return builder(iter(leaves))


def _prepared(spec: pytree.TreeSpec, sample: Sequence[Any]) -> Builder:
    """The rebuild of ``spec``, checked on ``sample`` leaves against pytree's."""
    builder = _builder(spec)
    if _same(builder(iter(sample)), pytree.tree_unflatten(list(sample), spec)):
        return builder
    return lambda leaves: pytree.tree_unflatten(list(leaves), spec)


def _builder(spec: pytree.TreeSpec) -> Builder:
    if spec.is_leaf():
        return next
    kind = spec.type
    specs = spec.children() if hasattr(spec, "children") else spec.children_specs
    children = [_builder(child) for child in specs]
    if kind is tuple:
        return lambda leaves: tuple([child(leaves) for child in children])
    if kind is list:
        return lambda leaves: [child(leaves) for child in children]
    if kind is dict:
        keys = list(spec.context)
        return lambda leaves: {key: child(leaves) for key, child in zip(keys, children)}
    if isinstance(kind, type) and issubclass(kind, OrderedDict) and dataclasses.is_dataclass(kind):
        return _mapping_dataclass(kind, list(spec.context), children)
    count = spec.num_leaves
    return lambda leaves: pytree.tree_unflatten([next(leaves) for _ in range(count)], spec)


def _mapping_dataclass(kind: type, keys: list[Any], children: list[Builder]) -> Builder:
    """A dataclass kept as an ordered mapping, as its constructor leaves it given ``keys``."""
    names = [field.name for field in dataclasses.fields(kind)]

    def build(leaves: Iterator[Any]) -> Any:
        given = {key: child(leaves) for key, child in zip(keys, children)}
        made = kind.__new__(kind)
        OrderedDict.__init__(made)
        attributes = made.__dict__
        for name in names:
            value = given.get(name)
            attributes[name] = value
            if value is not None:
                OrderedDict.__setitem__(made, name, value)
        return made

    return build


def _same(mine: Any, theirs: Any) -> bool:
    """Whether two rebuilds are the same structure holding the same leaves."""
    if type(mine) is not type(theirs):
        return False
    if isinstance(mine, (tuple, list)):
        return len(mine) == len(theirs) and all(map(_same, mine, theirs))
    if isinstance(mine, dict):
        if list(mine) != list(theirs) or not all(_same(mine[k], theirs[k]) for k in mine):
            return False
        if dataclasses.is_dataclass(mine):
            return list(vars(mine)) == list(vars(theirs)) and all(
                _same(value, vars(theirs)[name]) for name, value in vars(mine).items()
            )
        return True
    return mine is theirs
