"""``GridPositions``: a SigLIP2 NaFlex tower's position embeddings per patch grid, kept for the
grids used last. Rows must equal what the tower's own resize gives each image of a padded batch
(exactly: the same function), whatever the transformers release."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_siglip2_adapter import tower

from layergraph_adapters.kit.grid_positions import GridPositions

GRIDS = [(3, 5), (2, 1), (7, 1), (1, 9), (6, 6), (1, 1)]
"""Grids smaller and larger than the 4x4 table, one patch wide or high."""


def batch_resize(embeddings: torch.nn.Module, grids: list[tuple[int, int]]) -> torch.Tensor:
    """The tower's resize of its table for a padded batch of ``grids``, as its forward does."""
    side = embeddings.position_embedding_size
    table = embeddings.position_embedding.weight.reshape(side, side, -1)
    length = max(height * width for height, width in grids)
    return embeddings.resize_positional_embeddings(table, torch.tensor(grids), length)


def test_rows_are_the_towers_resize_of_each_image_of_a_padded_batch() -> None:
    embeddings = tower().embeddings
    positions = GridPositions(embeddings, rows=1024)
    with torch.inference_mode():
        expected = batch_resize(embeddings, GRIDS)
        for image, (rows, (height, width)) in enumerate(zip(positions(GRIDS), GRIDS)):
            assert torch.allclose(rows, expected[image, : height * width], atol=1e-6)


def test_the_grids_used_last_are_kept_up_to_the_rows_given() -> None:
    positions = GridPositions(tower().embeddings, rows=40)
    with torch.inference_mode():
        first = positions([(3, 5), (2, 1)])  # 17 rows
        assert all(a is b for a, b in zip(positions([(3, 5), (2, 1)]), first))
        positions([(6, 6)])  # 53 rows: the least recently used grid, (3, 5), is dropped
        assert positions([(2, 1)])[0] is first[1]
        assert positions([(3, 5)])[0] is not first[0]
        big = positions([(6, 6), (7, 7)])  # one call above the limit: both kept for it
        assert [rows.shape[0] for rows in big] == [36, 49]


def test_rows_follow_the_table_when_it_is_written_in_place() -> None:
    embeddings = tower().embeddings
    positions = GridPositions(embeddings, rows=1024)
    with torch.inference_mode():
        before = positions([(3, 5)])[0]
    with torch.no_grad():
        embeddings.position_embedding.weight.mul_(-2)
    with torch.inference_mode():
        after = positions([(3, 5)])[0]
        assert torch.allclose(after, -2 * before, atol=1e-6)
        assert torch.allclose(after, batch_resize(embeddings, [(3, 5)])[0])


def test_a_table_made_in_inference_mode_is_resized_on_every_call() -> None:
    with torch.inference_mode():
        embeddings = tower().embeddings
        positions = GridPositions(embeddings, rows=1024)
        first = positions([(3, 5)])[0]
        embeddings.position_embedding.weight.add_(1)  # tracks no version
        second = positions([(3, 5)])[0]
        assert second is not first
        assert torch.allclose(second, batch_resize(embeddings, [(3, 5)])[0])
