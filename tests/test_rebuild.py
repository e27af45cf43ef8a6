"""A prepared rebuild of a graph's output is the object pytree's ``tree_unflatten`` makes: same
types, items, attributes and leaves, for model outputs, containers and nodes of other types;
a structure is prepared the second time it is seen."""

from __future__ import annotations

import collections
import dataclasses
import pickle
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from layergraph.rebuild import Rebuilds

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import BaseModelOutputWithPooling  # noqa: E402

Pair = collections.namedtuple("Pair", ["first", "second"])


def outputs() -> list[Any]:
    x, y, z = torch.randn(2, 3), torch.randn(2), torch.randn(1)
    return [
        BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=y),
        BaseModelOutputWithPooling(last_hidden_state=x, hidden_states=(y, z)),
        (x, [y, {"z": z}]),
        {"pair": Pair(x, y), "out": BaseModelOutputWithPooling(last_hidden_state=z)},
        x,
    ]


def same(mine: Any, theirs: Any) -> None:
    assert type(mine) is type(theirs)
    if isinstance(mine, (tuple, list)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            same(a, b)
    elif isinstance(mine, dict):
        assert list(mine) == list(theirs)
        for key in mine:
            same(mine[key], theirs[key])
        if dataclasses.is_dataclass(mine):
            assert vars(mine).keys() == vars(theirs).keys()
            for name in vars(mine):
                same(getattr(mine, name), getattr(theirs, name))
    else:
        assert mine is theirs


@pytest.mark.parametrize("index", range(5))
def test_a_prepared_rebuild_is_what_pytree_makes(index: int) -> None:
    output = outputs()[index]
    leaves, spec = pytree.tree_flatten(output)
    rebuilds = Rebuilds()
    for _ in range(3):  # pytree's, then prepared, then prepared again
        fresh = [torch.randn_like(leaf) for leaf in leaves]
        same(rebuilds(fresh, spec), pytree.tree_unflatten(fresh, spec))


def test_a_rebuilt_model_output_behaves_as_a_constructed_one() -> None:
    output = outputs()[1]
    leaves, spec = pytree.tree_flatten(output)
    rebuilds = Rebuilds()
    rebuilds(leaves, spec)
    made = rebuilds(leaves, spec)
    assert made[0] is leaves[0] and made["hidden_states"][1] is leaves[2]
    assert made.pooler_output is None and made.to_tuple()[0] is leaves[0]
    assert list(made.keys()) == ["last_hidden_state", "hidden_states"]
    again = pickle.loads(pickle.dumps(made))
    assert torch.equal(again.last_hidden_state, leaves[0]) and again.pooler_output is None


def test_a_structure_the_prepared_rebuild_does_not_match_is_left_to_pytree() -> None:
    """A mapping dataclass whose constructor does more than store its fields (here, a derived
    attribute): the check against pytree's rebuild finds the difference."""

    @dataclasses.dataclass
    class Derived(collections.OrderedDict):
        value: Any = None

        def __post_init__(self) -> None:
            self["value"] = self.value
            self.extra = "derived"

    pytree.register_pytree_node(
        Derived,
        lambda d: ([d.value], ["value"]),
        lambda values, context: Derived(value=values[0]),
    )
    try:
        leaves, spec = pytree.tree_flatten(Derived(value=torch.ones(1)))
        rebuilds = Rebuilds()
        rebuilds(leaves, spec)
        assert rebuilds(leaves, spec).extra == "derived"
    finally:
        pytree._deregister_pytree_node(Derived)


def test_only_structures_seen_twice_are_prepared_and_few_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pytree rebuilds a structure seen for the first time, and once more to check the prepared
    rebuild the second time; then never. A structure pushed out is new again."""
    unflatten = pytree.tree_unflatten
    by_pytree: list[int] = []

    def counted(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
        by_pytree.append(spec.num_leaves)
        return unflatten(leaves, spec)

    monkeypatch.setattr(pytree, "tree_unflatten", counted)
    rebuilds = Rebuilds(kept=2)
    flat = [pytree.tree_flatten(output) for output in outputs()[:3]]
    for leaves, spec in flat[:1] * 4:
        rebuilds(leaves, spec)
    assert len(by_pytree) == 2
    for leaves, spec in flat * 2:  # three structures, two kept: the first prepared one is
        rebuilds(leaves, spec)  # found, then each is pushed out before it comes again
    assert len(by_pytree) == 2 + 5
