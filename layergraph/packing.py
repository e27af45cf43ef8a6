"""Packed calls: many images of different sizes in one sequence, served by token budgets.

Some towers (Qwen2-VL's, SigLIP2 NaFlex) take every image at its own resolution: the patches of
all images of a call are packed into one sequence, and which tokens attend to each other is
data (``cu_seqlens``), not shape. A graph cannot be captured per image mix; it is captured per
token *budget* instead, and every call whose tokens fit is written into the budget's buffers in
place, padded past its real tokens. A plan whose calls pack this way sets
:attr:`~layergraph.adapter.CapturePlan.packing` to a :class:`Packing`, which says how a call
becomes buffers and back; the runner chooses the budget (:mod:`layergraph.serving.policy`),
captures, replays and measures, as it does for batch sizes.

What this module does not do: choose budgets, capture or replay (the runner does), or know any
model (the plan's :class:`Packing` does).
"""

from __future__ import annotations

import dataclasses
import warnings
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from torch.utils import _pytree as pytree

from .warn import LayergraphDeprecationWarning

__all__ = ["Call", "PackedCall", "Packing", "buffer_tensors", "split_ranges"]


class Call(Protocol):
    """What the engine reads of any call it serves: a :class:`PackedCall`, or a
    :class:`~layergraph.keys.CallInputs` (a batch, packed by rows)."""

    @property
    def size(self) -> int:
        """The call's size in the unit keys count: rows of a batch, tokens of a packed call."""

    @property
    def signature(self) -> Hashable:
        """What fixes a graph besides its size."""

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The inputs whose device and dtype must be the model's for a graph to serve."""

    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's own ``(args, kwargs)``, as an eager call takes them."""


CallT = TypeVar("CallT", bound=Call)
PartsT = TypeVar("PartsT")


@dataclass(frozen=True, eq=False)
class PackedCall(Generic[PartsT]):
    """One call of a packed plan, as its :class:`Packing` read it on the host.

    The runner reads :attr:`size` to choose a budget, :attr:`signature` (with the budget) to find
    the graph, and :attr:`tensors` for its device and dtype checks; the plan reads
    :meth:`argument` in ``eager_reason`` as it would on a
    :class:`~layergraph.keys.CallInputs`. :attr:`parts` is the plan's own: what it computed
    from the call to load it into buffers (per-image grids, metadata on the host), of the
    type the call is parametrised by (``PackedCall[Images]``).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: int
    """Tokens the call holds: the budget it needs."""
    signature: Hashable
    """What fixes a graph besides the budget (dtypes, fixed arguments, a sequence budget)."""
    tensors: tuple[torch.Tensor, ...]
    """The inputs whose device and dtype must be the model's for a graph to serve."""
    parts: PartsT = field(default=cast(Any, None), repr=False)

    @property
    def batch(self) -> int:
        """Deprecated: :attr:`size` (the same number), until layergraph 0.3."""
        warnings.warn(
            "PackedCall.batch is PackedCall.size (the call's tokens) since layergraph 0.2.0; "
            "batch goes in 0.3",
            LayergraphDeprecationWarning,
            stacklevel=2,
        )
        return self.size

    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's own ``(args, kwargs)``."""
        return self.args, self.kwargs

    def argument(self, name: str, position: int | None = None, default: Any = None) -> Any:
        """The value of argument ``name`` (keyword, or ``position`` among positional ones)."""
        if name in self.kwargs:
            return self.kwargs[name]
        if position is not None and 0 <= position < len(self.args):
            return self.args[position]
        return default


def split_ranges(sizes: Sequence[int], budget: int) -> list[range]:
    """Consecutive ranges of part indices, in order, covering every part: each range's sizes
    sum to at most ``budget``, except a part larger than ``budget``, which is a range of its
    own. The cut :meth:`Packing.split` makes, for packings whose parts are images."""
    ranges: list[range] = []
    first = tokens = 0
    for index, size in enumerate(sizes):
        if tokens + size > budget and index > first:
            ranges.append(range(first, index))
            first, tokens = index, 0
        tokens += size
        if size > budget:
            ranges.append(range(first, index + 1))
            first, tokens = index + 1, 0
    if len(sizes) > first:
        ranges.append(range(first, len(sizes)))
    return ranges


class Packing(ABC, Generic[CallT]):
    """How a plan's calls are packed into token budgets, loaded into buffers and cut back out.

    The engine serves every plan through one: a packed plan's own (``CapturePlan.packing``),
    or, for a plan whose calls are batches, :class:`~layergraph.rows.RowPacking`, whose calls
    are :class:`~layergraph.keys.CallInputs` and whose budgets are batch sizes.

    Workflow, driven by the runner: :meth:`pack` reads a call on the host; the runner picks a
    budget of at least its :attr:`PackedCall.size` tokens (multiples of :attr:`budget_step`, at
    most :attr:`largest_budget` unless the user gave budgets); for a new budget
    :meth:`allocate` makes the buffers, which are also the plan's per-key state (bound around
    capture through :meth:`~layergraph.adapter.CapturePlan.bound`); before every replay
    :meth:`load` writes the call into them, padding past its real tokens so that no real token
    attends to padding; :meth:`cut` takes the real rows out of the graph's outputs. A call
    above every budget is :meth:`split` (by images, an image above every budget a piece of its
    own, run eagerly) and the pieces' outputs are :meth:`join`-ed.
    """

    size_unit: str = "tokens"
    """What a call's size counts, as the statistics name it: ``"tokens"`` (``"batch"`` for
    :class:`~layergraph.rows.RowPacking`)."""
    budget_unit: int = 1
    """Every budget, learnt or given, is a multiple of this many tokens: the call's indivisible
    group of rows (a patch merger's 2x2 patches), so that padding never shares a group with a
    real token."""
    budget_step: int = 1
    """Every learnt budget is a multiple of this many tokens (and of :attr:`budget_unit`)."""
    largest_budget: int = 1 << 14
    """The largest budget learnt (``batch_sizes="auto"``); larger calls are split."""
    later_warmup_runs: int | None = 1
    """Warm-up runs before capturing a budget for a call signature already captured since the
    model last changed (its kernels' lazy initialisation has run); ``None``: every capture
    warms up ``warmup_runs`` times."""

    @abstractmethod
    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallT:
        """Read a call; raise :class:`~layergraph.keys.UnsupportedCall` (the reason it runs
        eagerly) for one a graph cannot take."""

    @abstractmethod
    def split(self, call: CallT, budget: int) -> list[CallT]:
        """The call cut, in order, into calls whose joined outputs are the call's: each of at
        most ``budget`` tokens, except an indivisible part (an image) larger than that, which
        is a call of its own (the runner runs it eagerly)."""

    @abstractmethod
    def allocate(self, budget: int, call: CallT) -> Any:
        """The buffers of a graph of ``budget`` tokens for calls like ``call`` (same
        signature): inputs and metadata. Their addresses never change afterwards."""

    @abstractmethod
    def load(self, buffers: Any, call: CallT) -> None:
        """Write ``call`` into ``buffers`` in place, padding past its real tokens."""

    @abstractmethod
    def arguments(self, buffers: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The region's ``(args, kwargs)`` that read ``buffers``."""

    @abstractmethod
    def cut(self, output: Any, call: CallT, budget: int) -> Any:
        """``output`` of a graph of ``budget`` tokens with only ``call``'s rows (views)."""

    def cut_leaves(
        self, leaves: Sequence[Any], spec: pytree.TreeSpec, call: CallT, budget: int
    ) -> tuple[list[Any], pytree.TreeSpec]:
        """:meth:`cut` on an output given as its pytree leaves and structure, returned the
        same way. Override it where the rows can be cut from the leaves directly."""
        whole = pytree.tree_unflatten(list(leaves), spec)
        return pytree.tree_flatten(self.cut(whole, call, budget))

    def plan_state(self, buffers: Any) -> Any:
        """What the plan's :meth:`~layergraph.adapter.CapturePlan.bound` is given around the
        warm-up and capture of a graph with ``buffers``: the buffers themselves."""
        return buffers

    def measured_arguments(self, buffers: Any, call: CallT) -> tuple[tuple[Any, ...], dict]:
        """The ``(args, kwargs)`` of the eager call a new graph is measured against: the call
        itself (the plan's region unbound, which is the model's own forward)."""
        return call.arguments()

    def measured_size(self, call: CallT, budget: int) -> int:
        """The size a new graph's measurement is of (the rows the backend's timing is told):
        the call's own, as the eager call :meth:`measured_arguments` makes is."""
        return call.size

    def output_problem(self, leaves: Sequence[Any], budget: int) -> str | None:
        """Why a graph's outputs may not be cut or joined across calls of other sizes, or
        ``None`` if they may (every packing's outputs may; batches' may not always)."""
        return None

    def join(self, parts: Sequence[Any]) -> Any:
        """The outputs of consecutive pieces of a split call as one output: tensors
        concatenated along the first dimension, anything else taken from the first piece."""
        flat = [pytree.tree_flatten(part) for part in parts]
        columns = zip(*(leaves for leaves, _ in flat))
        joined = [
            torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0]
            for column in columns
        ]
        return pytree.tree_unflatten(joined, flat[0][1])


def buffer_tensors(buffers: Any) -> list[torch.Tensor]:
    """The tensors inside a graph's buffers or a plan's per-key state (dataclasses, tuples,
    lists, dicts and tensors, nested), whose addresses the graph baked in."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(buffers):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += buffer_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found
