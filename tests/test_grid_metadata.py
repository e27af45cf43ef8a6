"""A call's host metadata joined from its grid entries' equals what transformers' functions give
for the whole ``grid_thw``, element for element, for drawn grids of images and videos; each
entry's is computed once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layergraph_adapters.kit.grid_metadata import GridMetadata, GridMetadataCache, join_boundaries

vision_utils = pytest.importorskip("transformers.vision_utils", reason="transformers >= 5.17")

MERGE, PATCH = 2, 14


def whole(grid: torch.Tensor, windows: bool, positions: str | None) -> GridMetadata:
    """The metadata of ``grid`` by transformers' functions, as the Qwen and GLM plans compute
    an entry's."""
    window_index = cu_window_seqlens = None
    if windows:
        window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
            grid, MERGE, 112, PATCH
        )
    interp_indices = interp_weights = None
    if positions is not None:
        interp_indices, interp_weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=12, mode=positions, spatial_merge_size=MERGE
        )
    return GridMetadata(
        position_ids=vision_utils.get_vision_position_ids(grid, MERGE),
        cu_seqlens=vision_utils.get_vision_cu_seqlens(grid),
        window_index=window_index,
        cu_window_seqlens=cu_window_seqlens,
        interp_indices=interp_indices,
        interp_weights=interp_weights,
    )


entries = st.tuples(
    st.integers(1, 3),
    st.integers(1, 14).map(lambda n: 2 * n),
    st.integers(1, 14).map(lambda n: 2 * n),
)


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(st.lists(entries, min_size=1, max_size=4), min_size=1, max_size=3),
    windows=st.booleans(),
    positions=st.sampled_from([None, "bilinear", "bicubic"]),
)
def test_joined_metadata_equals_the_whole_grids(
    calls: list[list[tuple[int, int, int]]], windows: bool, positions: str | None
) -> None:
    computed: list[tuple[int, int, int]] = []

    def entry(grid: torch.Tensor) -> GridMetadata:
        computed.append(tuple(grid[0].tolist()))
        return whole(grid, windows, positions)

    cache = GridMetadataCache(entry)
    for grids in calls:
        joined = cache(tuple(grids))
        want = whole(torch.tensor(grids), windows, positions)
        for name in GridMetadata.__dataclass_fields__:
            got, expected = getattr(joined, name), getattr(want, name)
            if expected is None:
                assert got is None, name
            else:
                assert got.dtype == expected.dtype and torch.equal(got, expected), name
    assert sorted(computed) == sorted({grid for grids in calls for grid in grids})


def test_a_recurring_call_is_kept_whole_and_old_entries_make_room() -> None:
    computed: list[tuple[int, ...]] = []

    def entry(grid: torch.Tensor) -> GridMetadata:
        computed.append(tuple(grid[0].tolist()))
        return whole(grid, windows=False, positions=None)

    cache = GridMetadataCache(entry, kept_entries=2, kept_calls=1)
    first = cache(((1, 2, 2), (1, 4, 4)))
    assert cache(((1, 2, 2), (1, 4, 4))) is first
    cache(((1, 6, 6),))  # drops (1, 2, 2), the oldest entry, and the first call
    cache(((1, 2, 2), (1, 4, 4)))  # (1, 2, 2) drops (1, 4, 4), which is computed again
    assert computed == [(1, 2, 2), (1, 4, 4), (1, 6, 6), (1, 2, 2), (1, 4, 4)]


def test_boundaries_join_where_the_spans_before_end() -> None:
    parts = [torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)]
    joined = join_boundaries(parts)
    assert joined.tolist() == [0, 3, 5, 9] and joined.dtype == torch.int32
