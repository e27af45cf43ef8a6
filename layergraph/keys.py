"""Shape keys, call signatures and batch buckets: which graph serves a call.

A graph replays one fixed computation on buffers of one fixed shape. This module turns a call's
arguments into the parts that decide which graph may serve it, and chooses the captured batch
size a smaller batch is padded up to. It holds no tensors beyond the call it inspects and knows
nothing of CUDA, so all of it runs and is tested on the CPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BatchBuckets", "CallInputs", "ShapeKey", "UnsupportedCall"]


@dataclass(frozen=True, slots=True)
class ShapeKey:
    """The key of one graph: the batch size it was captured for and the sequence it holds.

    ``sequence`` is whatever the adapter says fixes the graph besides the batch size: a token
    count, an image size, a tuple of per-sample shapes. Two calls with equal keys (and equal
    argument signatures) replay the same graph.
    """

    batch: int
    sequence: Hashable

    def __str__(self) -> str:
        return f"(batch={self.batch}, sequence={self.sequence})"


class UnsupportedCall(Exception):
    """A call whose arguments a graph cannot take; the message is the reason it runs eagerly."""


_TENSOR = object()


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Everything about a batched tensor argument that a graph fixes, except the batch size."""

    sample_shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.sample_shape)}"


class CallInputs:
    """A call's arguments, split into batched tensors and the fixed rest.

    Tensors may appear as top-level positional or keyword arguments; each is batched along its
    first dimension, and all must agree on the batch size. Every other argument becomes part of
    the signature, so a call with another value gets another graph: it must be hashable, or a
    list, tuple or dict of hashable values (keyed by its contents). Tensors nested inside lists
    or dicts are not supported (the call runs eagerly).

    The runner hands one to a plan's :meth:`~layergraph.adapter.CapturePlan.sequence_of`,
    :meth:`~layergraph.adapter.CapturePlan.eager_reason`,
    :meth:`~layergraph.adapter.CapturePlan.check_inputs` and
    :meth:`~layergraph.adapter.CapturePlan.key_state`. :attr:`tensors` holds the batched
    tensors in argument order, and :meth:`argument` reads any one argument, tensor or not, by
    name (and position, for one that may be passed either way):

    ```python
    def eager_reason(self, call: CallInputs) -> str | None:
        if call.argument("output_attentions"):
            return "attention weights were asked for (output_attentions=True)"
        return None

    def sequence_of(self, call: CallInputs) -> Hashable:
        pixels = call.argument("pixel_values", position=0)  # tower(x) or tower(pixel_values=x)
        return tuple(pixels.shape[-2:])
    ```
    """

    __slots__ = ("_kwarg_names", "_template", "batch", "signature", "tensors")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._kwarg_names = tuple(kwargs)
        values = (*args, *kwargs.values())
        tensors: list[torch.Tensor] = []
        template: list[Any] = []
        parts: list[Any] = []
        for value in values:
            if isinstance(value, torch.Tensor):
                if value.dim() == 0:
                    raise UnsupportedCall("a tensor argument has no batch dimension")
                tensors.append(value)
                template.append(_TENSOR)
                parts.append(TensorSpec(tuple(value.shape[1:]), value.dtype))
            else:
                if isinstance(value, (list, tuple, dict)) and _holds_tensor(value):
                    raise UnsupportedCall("tensors nested inside a list, tuple or dict")
                template.append(value)
                parts.append(_frozen(value))
        if not tensors:
            raise UnsupportedCall("the call has no tensor argument")
        batch = tensors[0].shape[0]
        if any(t.shape[0] != batch for t in tensors):
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise UnsupportedCall(f"tensor arguments disagree on the batch size: {shapes}")
        self.batch: int = batch
        """Rows of every batched tensor (their common first dimension)."""
        self.tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        """The batched tensors, positional ones first, then keyword ones, in call order."""
        self._template = template
        self.signature: Hashable = (len(args), self._kwarg_names, tuple(parts))
        """What a graph fixes besides the batch size: how the arguments were passed, each
        tensor's per-sample shape and dtype, and every other value. Calls of equal signatures
        in one bucket replay the same graph."""

    @property
    def size(self) -> int:
        """The call's rows (:attr:`batch`): its size in the unit batch graphs are keyed by."""
        return self.batch

    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's own ``(args, kwargs)``."""
        return self.rebuild(self.tensors)

    @property
    def sample_specs(self) -> tuple[TensorSpec, ...]:
        """The per-sample shape and dtype of each batched tensor, in argument order."""
        return tuple(p for p in self.signature[2] if isinstance(p, TensorSpec))

    def argument(self, name: str, position: int | None = None, default: Any = None) -> Any:
        """The value of argument ``name``, a tensor or a fixed value; ``default`` if not passed.

        ``position`` is the argument's index among the forward's positional parameters: give
        it to find an argument that may be passed either way (``pixel_values``); without it
        only a keyword argument is found. Tensors come back as the caller passed them.
        """
        if name in self._kwarg_names:
            return self._value(self._positional_count + self._kwarg_names.index(name))
        if position is not None and 0 <= position < self._positional_count:
            return self._value(position)
        return default

    @property
    def _positional_count(self) -> int:
        """How many arguments the call passed by position."""
        return len(self._template) - len(self._kwarg_names)

    def _value(self, slot: int) -> Any:
        """The argument in ``slot`` of the call, its tensor put back."""
        value = self._template[slot]
        if value is not _TENSOR:
            return value
        return self.tensors[sum(v is _TENSOR for v in self._template[:slot])]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's ``(args, kwargs)`` with its tensors replaced by ``tensors``, in order."""
        replacements = iter(tensors)
        values = [next(replacements) if v is _TENSOR else v for v in self._template]
        n_args = self._positional_count
        return tuple(values[:n_args]), dict(zip(self._kwarg_names, values[n_args:]))

    def sliced(self, start: int, stop: int) -> CallInputs:
        """The same call on rows ``start:stop`` of every batched tensor."""
        args, kwargs = self.rebuild([t[start:stop] for t in self.tensors])
        return CallInputs(args, kwargs)


def _frozen(value: Any) -> Hashable:
    """``value`` itself if hashable; lists and dicts as tuples of their frozen contents."""
    if isinstance(value, list):
        return (list, tuple(_frozen(item) for item in value))
    if isinstance(value, dict):
        return (dict, tuple((key, _frozen(item)) for key, item in value.items()))
    try:
        hash(value)
    except TypeError:
        raise UnsupportedCall(f"argument of type {type(value).__name__} is not hashable") from None
    return value


def _holds_tensor(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(
        isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple, dict)) and _holds_tensor(v))
        for v in items
    )


class BatchBuckets:
    """The batch sizes graphs are captured for, and the one a batch is padded up to.

    With sizes given, a batch of ``b`` rows is served by the graph of the smallest size
    ``>= b``; a batch larger than every size is split into chunks of the largest. With
    ``sizes=None`` every batch size is its own bucket (exact shapes, no padding).
    """

    def __init__(self, sizes: Iterable[int] | None) -> None:
        if sizes is None:
            self.sizes: tuple[int, ...] | None = None
            return
        sizes = tuple(sizes)
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad or not sizes:
            raise ValueError(
                f"batch_sizes must be positive integers, got {list(sizes)!r}"
                if bad
                else "batch_sizes must not be empty; pass None to capture exact batch sizes"
            )
        self.sizes = tuple(sorted(set(sizes)))

    @property
    def exact(self) -> bool:
        """Whether every batch size gets a graph of its own."""
        return self.sizes is None

    @property
    def largest(self) -> int | None:
        """The largest bucket, or ``None`` in exact mode."""
        return None if self.sizes is None else self.sizes[-1]

    def bucket_for(self, batch: int) -> int | None:
        """The batch size whose graph serves ``batch`` rows, or ``None`` if it must be split."""
        if batch < 1:
            raise ValueError(f"batch size must be at least 1, got {batch}")
        if self.sizes is None:
            return batch
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def chunks(self, batch: int) -> list[tuple[int, int]]:
        """Row ranges ``(start, stop)`` that split ``batch`` into pieces of the largest bucket."""
        step = self.largest or batch
        return [(start, min(start + step, batch)) for start in range(0, batch, step)]
