"""A SigLIP2 NaFlex tower's position embeddings per patch grid, for its packed graphs.

The tower resizes its learned ``side x side`` position table to each image's patch grid. Its
packed graphs read the resized rows from a buffer, written before every replay
(:mod:`layergraph_adapters.kit.naflex`); :class:`GridPositions` makes them, by the tower's own
``resize_positional_embeddings``, so that they are the tower's in every transformers release
(up to 5.23 an antialiased ``F.interpolate`` per image; from 5.24 explicit weights, which differ
from it for grids one patch wide, where PyTorch's CPU kernel gives every row the first row's
values), and keeps the grids used last, so that a call of grids seen before costs no resize.

What it does not do: write buffers (the plan does), or notice a table changed by other means
than PyTorch tracks (its version counter): :meth:`GridPositions.forget` drops every grid.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["GridPositions"]


class GridPositions:
    """The position embeddings of ``embeddings`` (a ``Siglip2VisionEmbeddings``) for each patch
    grid asked for, kept for the grids used last, ``rows`` rows in all at most (the grids of one
    call are kept whatever their size).

    Kept rows are dropped when the table moves, changes dtype or is written in place; a table
    that tracks no versions (made under ``torch.inference_mode()``) is resized on every call.
    """

    def __init__(self, embeddings: nn.Module, rows: int) -> None:
        self._embeddings = embeddings
        self._limit = rows
        self._kept: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._rows = 0
        self._stamp: tuple[object, ...] | None = None

    def __call__(self, grids: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Each grid's ``[height * width, width]`` rows, in row-major patch order."""
        table = self._embeddings.position_embedding.weight
        stamp = (
            None
            if table.is_inference()
            else (table.data_ptr(), table.device, table.dtype, table._version)
        )
        if stamp is None or stamp != self._stamp:
            self.forget()
            self._stamp = stamp
        rows = []
        for grid in grids:
            kept = self._kept.get(grid)
            if kept is None:
                kept = self._resize(table, grid)
                if stamp is not None:
                    self._kept[grid] = kept
                    self._rows += kept.shape[0]
            else:
                self._kept.move_to_end(grid)
            rows.append(kept)
        while self._rows > self._limit and len(self._kept) > len(set(grids)):
            _, dropped = self._kept.popitem(last=False)
            self._rows -= dropped.shape[0]
        return rows

    def forget(self) -> None:
        """Drop every grid kept."""
        self._kept.clear()
        self._rows = 0

    def _resize(self, table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        side = self._embeddings.position_embedding_size
        shapes = torch.tensor([grid], device=table.device)
        resized = self._embeddings.resize_positional_embeddings(
            table.reshape(side, side, -1), shapes, max_length=grid[0] * grid[1]
        )
        return resized[0]
