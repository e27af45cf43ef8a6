"""split_ranges: how a packed call above every budget is cut into pieces, by images."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from layergraph import LayergraphDeprecationWarning
from layergraph.packing import split_ranges


@given(st.lists(st.integers(1, 40), max_size=12), st.integers(1, 32))
def test_pieces_cover_every_part_in_order_and_fit_the_budget_or_hold_one_part(
    sizes: list[int], budget: int
) -> None:
    ranges = split_ranges(sizes, budget)
    assert [i for piece in ranges for i in piece] == list(range(len(sizes)))
    for piece in ranges:
        assert len(piece) > 0
        total = sum(sizes[i] for i in piece)
        assert total <= budget or len(piece) == 1
    for before, after in itertools.pairwise(ranges):  # greedy: the next part did not fit
        if max(sizes[i] for i in after) <= budget and sum(sizes[i] for i in before) <= budget:
            assert sum(sizes[i] for i in before) + sizes[after.start] > budget


def test_an_image_above_the_budget_is_a_piece_of_its_own() -> None:
    assert split_ranges([6, 72, 1], 64) == [range(0, 1), range(1, 2), range(2, 3)]
    assert split_ranges([36, 28, 10, 25], 64) == [range(0, 2), range(2, 4)]
    assert split_ranges([], 64) == []


def test_a_packed_calls_batch_is_its_size_with_a_deprecation() -> None:
    import pytest
    import torch

    from layergraph.packing import PackedCall

    call = PackedCall((), {}, size=12, signature=(), tensors=(torch.zeros(1),))
    with pytest.warns(LayergraphDeprecationWarning, match="PackedCall.batch is PackedCall.size"):
        assert call.batch == 12
