"""Comparing a graph's output with eager output, with a tolerance stated per dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "DEFAULT_TOLERANCE",
    "GraphMismatchError",
    "compare_outputs",
    "first_tensor",
    "relative_error",
]

DEFAULT_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
"""Largest accepted ``||graph - eager|| / ||eager||`` per output dtype.

A graph replays the kernels eager runs, so equal shapes usually give equal bits; the slack
covers a padded batch, where the matrix products see more rows and may pick other kernels.
"""


class GraphMismatchError(RuntimeError):
    """A graph's output differed from eager output beyond the tolerance."""


def first_tensor(output: Any) -> torch.Tensor:
    """The first tensor of a model's output (a tensor, tuple, dict or model-output object)."""
    return next(leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (NaN if either holds a NaN)."""
    actual, expected = actual.double(), expected.double()
    if torch.isnan(actual).any() or torch.isnan(expected).any():
        return float("nan")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def compare_outputs(
    graph_output: Any, eager_output: Any, *, tolerance: float | None, context: str
) -> float:
    """Raise :class:`GraphMismatchError` unless every tensor leaf agrees; return the worst error.

    ``tolerance=None`` takes :data:`DEFAULT_TOLERANCE` for each leaf's dtype.
    """
    graph_leaves, graph_spec = pytree.tree_flatten(graph_output)
    eager_leaves, eager_spec = pytree.tree_flatten(eager_output)
    if graph_spec != eager_spec:
        raise GraphMismatchError(f"{context}: graph output structure {graph_spec} != {eager_spec}")
    worst = 0.0
    for index, (got, want) in enumerate(zip(graph_leaves, eager_leaves)):
        if not isinstance(want, torch.Tensor):
            continue
        if got.shape != want.shape:
            raise GraphMismatchError(
                f"{context}: output {index} has shape {tuple(got.shape)} from the graph and "
                f"{tuple(want.shape)} from eager"
            )
        if not want.is_floating_point():
            if not torch.equal(got, want):
                raise GraphMismatchError(f"{context}: output {index} ({want.dtype}) differs")
            continue
        limit = DEFAULT_TOLERANCE.get(want.dtype, 1e-4) if tolerance is None else tolerance
        error = relative_error(got, want)
        if not error <= limit:
            largest = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item()
            raise GraphMismatchError(
                f"{context}: output {index} (shape {tuple(want.shape)}, {want.dtype}) differs "
                f"from eager: relative error {error:.3g} > tolerance {limit:.3g}; largest "
                f"absolute difference {largest:.3g}"
            )
        worst = max(worst, error)
    return worst
