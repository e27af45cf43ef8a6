"""Batches as packings of rows: how a plan keyed by batch size reaches the engine.

The engine serves every plan through a :class:`~layergraph.packing.Packing`. A plan whose
calls are batches of same-shaped inputs has :class:`RowPacking`: a call is a
:class:`~layergraph.keys.CallInputs`, a budget is a batch size, a graph's buffers are zero
rows of each batched tensor plus the plan's per-key state
(:meth:`~layergraph.adapter.CapturePlan.key_state`), a smaller batch is padded with zero rows
and cut back to its rows, and chunks of a larger batch are joined along the batch.

What this module does not do: choose batch sizes, routes or chunks (the batched lane does), or
capture and replay (the engine does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .adapter import CapturePlan
from .keys import CallInputs, ShapeKey
from .packing import Packing

__all__ = ["NotPerRow", "RowBuffers", "RowPacking", "concatenate", "not_per_row"]


@dataclass(frozen=True, eq=False)
class RowBuffers:
    """A batch graph's buffers: its static inputs and the plan's per-key state."""

    inputs: tuple[torch.Tensor, ...]
    """One buffer per batched tensor argument, of the key's batch size, in argument order."""
    state: Any
    """The plan's :meth:`~layergraph.adapter.CapturePlan.key_state` (attention metadata,
    workspaces), bound around the graph's capture."""
    args: tuple[Any, ...] = field(repr=False)
    kwargs: dict[str, Any] = field(repr=False)
    """The region's arguments that read :attr:`inputs`, passed as the captured call passed
    its own."""


class RowPacking(Packing[CallInputs]):
    """Batches of a plan keyed by batch size, as packings of rows (see the module's text)."""

    later_warmup_runs = None
    size_unit = "batch"

    def __init__(self, plan: CapturePlan) -> None:
        self.plan = plan

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallInputs:
        call = CallInputs(args, kwargs)
        if call.batch == 0:
            raise ValueError(
                f"empty batch: the tensor arguments have 0 rows "
                f"({', '.join(str(tuple(t.shape)) for t in call.tensors)})"
            )
        return call

    def split(self, call: CallInputs, budget: int) -> list[CallInputs]:
        return [
            call.sliced(start, min(start + budget, call.batch))
            for start in range(0, call.batch, budget)
        ]

    def allocate(self, budget: int, call: CallInputs) -> RowBuffers:
        inputs = tuple(
            torch.zeros((budget, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for t in call.tensors
        )
        key = ShapeKey(budget, self.plan.sequence_of(call))
        args, kwargs = call.rebuild(inputs)
        return RowBuffers(inputs, self.plan.key_state(key, call), args, kwargs)

    def load(self, buffers: RowBuffers, call: CallInputs) -> None:
        """Copy the call's tensors into the static inputs and zero the padding rows."""
        for buffer, tensor in zip(buffers.inputs, call.tensors):
            rows = tensor.shape[0]
            if rows == buffer.shape[0]:
                buffer.copy_(tensor)
                continue
            buffer[:rows].copy_(tensor)
            buffer[rows:].zero_()

    def arguments(self, buffers: RowBuffers) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return buffers.args, buffers.kwargs

    def cut(self, output: Any, call: CallInputs, budget: int) -> Any:
        leaves, spec = pytree.tree_flatten(output)
        return pytree.tree_unflatten(self.cut_leaves(leaves, spec, call, budget)[0], spec)

    def cut_leaves(
        self, leaves: Sequence[Any], spec: pytree.TreeSpec, call: CallInputs, budget: int
    ) -> tuple[list[Any], pytree.TreeSpec]:
        """The first ``call.batch`` rows of every tensor output (a padded call's outputs are
        one row per input: the engine checked at capture)."""
        rows = call.batch
        if rows == budget:
            return list(leaves), spec
        return [t[:rows] if isinstance(t, torch.Tensor) else t for t in leaves], spec

    def plan_state(self, buffers: RowBuffers) -> Any:
        return buffers.state

    def measured_arguments(
        self, buffers: RowBuffers, call: CallInputs
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The graph's own inputs: an eager call of the key's whole batch."""
        return self.arguments(buffers)

    def measured_size(self, call: CallInputs, budget: int) -> int:
        return budget

    def output_problem(self, leaves: Sequence[Any], budget: int) -> str | None:
        return not_per_row(leaves, budget)


def not_per_row(leaves: Sequence[Any], rows: int) -> str | None:
    """Which tensor among an output's ``leaves`` is not one row per input of ``rows`` rows, or
    ``None`` if each is. A tensor whose first dimension equals ``rows`` by coincidence (a mean
    over 4 rows of 4 features) passes."""
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dim() == 0:
            return f"output {index} is 0-d"
        if leaf.shape[0] != rows:
            return f"output {index} has {leaf.shape[0]} rows for {rows} inputs"
    return None


class NotPerRow(Exception):
    """Chunk outputs that cannot be joined along the batch; the message says which output."""


def concatenate(parts: Sequence[Any], rows: Sequence[int]) -> Any:
    """Join the outputs of consecutive batch chunks, of ``rows`` rows each, along the batch.

    Raises :class:`NotPerRow` rather than join a tensor that is not one row per input in every
    chunk, or keep one chunk's value of anything else that differs between chunks.
    """
    flat = [pytree.tree_flatten(part) for part in parts]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise NotPerRow("the chunks' outputs differ in structure")
    for (leaves, _), count in zip(flat, rows):
        problem = not_per_row(leaves, count)
        if problem is not None:
            raise NotPerRow(problem)
    joined = []
    for index, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        if isinstance(column[0], torch.Tensor):
            joined.append(torch.cat(column))
        elif all(value == column[0] for value in column):
            joined.append(column[0])
        else:
            raise NotPerRow(f"output {index} differs between chunks")
    return pytree.tree_unflatten(joined, spec)
