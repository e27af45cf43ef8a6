"""A learned position table resampled to each patch as one matrix product (positions_matmul).

GLM-4.1V's and GLM-4.5V's towers learn a square table of position embeddings and resample it
to every patch of every image with ``F.grid_sample`` (bicubic, border padding, corners not
aligned) over the table laid out ``[1, width, side, side]``: each patch reads sixteen rows of
the table, one channel at a time, far apart in memory. :func:`bicubic_rows` computes the same
resampling as a ``[patches, side * side]`` matrix of interpolation weights (sixteen per row,
scattered where the taps fall, clamped taps adding up) times the table viewed as ``[side *
side, width]``: one small scatter and one float32 matrix product, whose rows read the table's
rows whole. Values change by float32 rounding only (the sums run in another order).

:class:`ResampledPositions` computes the embeddings module's forward that way while applied
(a change made through the wrapper's ledger); training calls run the module's own forward.

What it does not do: other interpolation modes (the module's ``interpolated_method`` must be
``"bicubic"``), or other padding or corner conventions than the towers'.
"""

from __future__ import annotations

import torch
from torch import nn

from layergraph_adapters.kit.rewrites import InferenceForward

__all__ = ["ResampledPositions", "bicubic_rows", "resampled_positions_for"]

_CUBIC_A = -0.75
"""The cubic convolution's coefficient that ``F.grid_sample`` uses."""


def bicubic_rows(table: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F.grid_sample(table as [1, width, side, side], grid of (x, y), mode="bicubic",
    padding_mode="border", align_corners=False)`` for ``[side * side, width]`` ``table`` and
    ``[points]`` coordinates normalised to ``[-1, 1]``, as ``[points, width]`` in float32."""
    side = round(table.shape[0] ** 0.5)
    weights = torch.zeros(x.shape[0], side * side, dtype=torch.float32, device=table.device)
    columns, column_weights = _taps(x.float(), side)
    rows, row_weights = _taps(y.float(), side)
    index = (rows[:, :, None] * side + columns[:, None, :]).flatten(1)
    weight = (row_weights[:, :, None] * column_weights[:, None, :]).flatten(1)
    weights.scatter_add_(1, index, weight)
    return weights @ table.float()


def _taps(coordinate: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The four taps along one axis of each normalised ``coordinate`` (clamped to the table,
    as border padding reads them) and their cubic convolution weights."""
    position = ((coordinate + 1) * side - 1) / 2
    start = torch.floor(position)
    t = position - start
    distances = torch.stack((t + 1, t, 1 - t, 2 - t), dim=-1)
    near = ((_CUBIC_A + 2) * distances - (_CUBIC_A + 3)) * distances * distances + 1
    far = ((_CUBIC_A * distances - 5 * _CUBIC_A) * distances + 8 * _CUBIC_A) * distances
    far = far - 4 * _CUBIC_A
    weights = torch.where(distances <= 1, near, far)
    offsets = torch.arange(-1, 3, device=coordinate.device, dtype=start.dtype)
    taps = (start[:, None] + offsets).clamp(0, side - 1).long()
    return taps, weights


def resampled_positions_for(
    embeddings: nn.Module | None, setting: bool, resamples: bool = True
) -> list[ResampledPositions]:
    """The :class:`ResampledPositions` for an adapter's ``positions_matmul`` option, or none
    without it. ``resamples``: whether the tower's family record says its ``embeddings``
    resample their table with ``grid_sample`` (GLM-4.1V's and GLM-4.5V's). Raises
    ``ValueError`` where they do not, or where ``embeddings`` (``None`` for a tower without)
    is not a module it serves."""
    if not setting:
        return []
    if embeddings is None or not resamples:
        raise ValueError(
            "positions_matmul resamples a learned position table with grid_sample (the "
            "GLM-4.1V and GLM-4.5V towers do); this tower does not"
        )
    return [ResampledPositions(embeddings)]


class ResampledPositions(InferenceForward):
    """Computes a GLM vision embeddings module's forward (patch embeddings plus the position
    table resampled to each patch's place in its image) with :func:`bicubic_rows` while
    applied.

    Raises ``ValueError`` for a module without a position table, an interpolation other than
    bicubic, or a table that is not square.
    """

    def __init__(self, embeddings: nn.Module) -> None:
        name = type(embeddings).__name__
        if not hasattr(embeddings, "position_embedding"):
            raise ValueError(f"positions_matmul needs a position_embedding table; {name} has none")
        if getattr(embeddings, "interpolated_method", None) != "bicubic":
            raise ValueError(
                f"positions_matmul computes bicubic resampling; {name} uses "
                f"{getattr(embeddings, 'interpolated_method', None)!r}"
            )
        rows = embeddings.position_embedding.weight.shape[0]
        if round(rows**0.5) ** 2 != rows:
            raise ValueError(f"positions_matmul needs a square position table, not {rows} rows")
        super().__init__(
            embeddings, "position table resampled as one matrix product (positions_matmul)"
        )

    def compute(
        self,
        embeddings: torch.Tensor,
        lengths: torch.Tensor | list[int],
        image_shapes: torch.Tensor,
        h_coords: torch.Tensor,
        w_coords: torch.Tensor,
    ) -> torch.Tensor:
        table = self.module.position_embedding.weight
        if isinstance(lengths, list):
            lengths = torch.tensor(lengths, device=table.device, dtype=torch.long)
        tokens = torch.arange(embeddings.shape[0], device=embeddings.device)
        image = (tokens[None, :] >= lengths.cumsum(0)[:, None]).sum(0)
        height = image_shapes[image, 1].to(torch.float32)
        width = image_shapes[image, 2].to(torch.float32)
        x = (w_coords + 0.5) / width * 2 - 1
        y = (h_coords + 0.5) / height * 2 - 1
        positions = bicubic_rows(table, x, y).to(table.dtype).to(embeddings.device)
        return embeddings + positions
