"""Tools for testing adapters: a CPU graph backend, a check, and a pytest plugin.

Adapter authors get the fixtures ``layergraph_registry`` and ``register_adapter`` in any test
from the pytest plugin ``layergraph`` (entry point ``pytest11``, the module
``layergraph_pytest``, which imports nothing heavy until a fixture is used), and call
:func:`check_adapter` to compare a wrapped model with the model itself.

:class:`SimulatedGraphs` is a graph backend for CPU tensors that keeps the contract of a CUDA
graph: a capture records the operators that run (:mod:`layergraph.tape`), and a replay runs
those operators again on the storages they used, with no Python of the model, its hooks or
layergraph in between. A runner that forgot to copy an input, returned a buffer it should have
cloned, or relied on Python that runs at capture (a hook appending to a list, a value computed
on the host, a field filled in after the forward) gives wrong answers here as it would on a
GPU. Its pools keep PyTorch's one rule for sharing: a capture may join a pool only while
one of the pool's graphs lives. Its captures refuse what a CUDA stream capture refuses and a
CPU run would not notice: reading a tensor's value on the host (``.item()``, ``bool(t)``) and
operators whose output size depends on values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``), each of which
waits for the GPU. Its pools model the memory a CUDA caching allocator reserves for graphs
(:class:`_SimulatedPool`), so that tests can check how captures share a pool; it does not
simulate kernels' timing or streams.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .graphs import GraphCaptureError
from .tape import Recorder, Tape

__all__ = [
    "AdapterCheck",
    "CaptureUnsafeOperation",
    "SimulatedGraphs",
    "check_adapter",
    "layergraph_registry",
    "register_adapter",
]


class CaptureUnsafeOperation(RuntimeError):
    """What a :class:`SimulatedGraphs` capture fails with (the cause of its
    :class:`~layergraph.graphs.GraphCaptureError`) at an operator that a CUDA stream capture
    refuses (``cudaErrorStreamCaptureUnsupported`` on a GPU)."""


_UNSAFE = {
    "aten::_local_scalar_dense": "reads a tensor's value on the host (.item(), bool(t), int(t))",
    "aten::nonzero": "has an output size that depends on values (nonzero)",
    "aten::masked_select": "has an output size that depends on values (masked_select)",
    "aten::_unique": "has an output size that depends on values (unique)",
    "aten::_unique2": "has an output size that depends on values (unique)",
    "aten::unique_dim": "has an output size that depends on values (unique)",
    "aten::unique_consecutive": "has an output size that depends on values (unique_consecutive)",
}
"""Operators a CUDA stream capture refuses, by name, with why."""


def _refuse_unsafe(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`CaptureUnsafeOperation` for an operator a CUDA stream capture refuses:
    :data:`_UNSAFE`, indexing by a boolean mask (``x[mask]``, ``x[mask] = y``), a masked fill
    with a tensor's value (pass a number), and ``repeat_interleave`` with tensor repeats and no
    ``output_size``."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    name = schema.name
    why = _UNSAFE.get(name)
    if why is None and name in ("aten::index", "aten::index_put", "aten::index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(
            isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
            for index in indices
        ):
            why = "indexes by a boolean mask, whose selected count depends on values"
    if (
        why is None
        and name in ("aten::masked_fill", "aten::masked_fill_")
        and func._overloadname == "Tensor"
    ):
        why = "fills with a tensor's value, which CUDA's kernel reads on the host (.item())"
    if (
        why is None
        and name == "aten::repeat_interleave"
        and func._overloadname in ("Tensor", "self_Tensor")
        and kwargs.get("output_size") is None
    ):
        why = "repeats by a tensor of counts without output_size"
    if why is not None:
        raise CaptureUnsafeOperation(
            f"{func} {why}: a CUDA graph cannot capture it (it waits for the GPU); "
            f"compute it before the captured region, or pass the result in as an input"
        )


_HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__"})
"""Tensor methods that read values on the host: under inference mode the CPU serves some of
them without reaching :func:`_refuse_unsafe`, so :class:`_HostReadRules` sees them first."""


class _HostReadRules(TorchFunctionMode):
    """Raises :class:`CaptureUnsafeOperation` for a tensor's value read on the host."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__name__", None) in _HOST_READS and "Tensor" in getattr(
            func, "__qualname__", ""
        ):
            raise CaptureUnsafeOperation(
                f"Tensor.{func.__name__} reads a tensor's value on the host (.item(), bool(t), "
                f"int(t)): a CUDA graph cannot capture it (it waits for the GPU); compute it "
                f"before the captured region, or pass the result in as an input"
            )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _stream_capturing() -> Iterator[None]:
    """Within, ``torch.cuda.is_current_stream_capturing()`` answers ``True``, as it does during
    a real capture: code that takes another path under capture (transformers' mask helpers,
    which then skip reading a padding mask on the host) takes that path in a simulated one."""
    original = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


@dataclass(eq=False)
class _SimulatedGraph:
    tape: Tape
    """The operators the capture ran, which a replay runs again."""
    output: Any


@dataclass(eq=False)
class _Block:
    """A span of a segment, free or allocated."""

    size: int
    free: bool


@dataclass(eq=False)
class _SimulatedPool:
    """The memory reserved for one graph pool, as PyTorch's caching allocator keeps it.

    The pool is a list of segments, each reserved once (never returned while the pool lives)
    and cut into blocks. An allocation takes the smallest free block that holds it, split if
    larger, or reserves a new segment of its size; a freed block merges with free neighbours
    of its segment. So a capture can take blocks that earlier captures freed (their
    intermediates, the outputs of a dropped graph), never the outputs of graphs alive, and a
    larger allocation than any free block grows the pool even when the free blocks together
    would hold it. What it leaves out: rounding of sizes, the small-allocation pool, and
    splitting limits.
    """

    segments: list[list[_Block]] = field(default_factory=list)
    graphs: weakref.WeakSet[_SimulatedGraph] = field(default_factory=weakref.WeakSet)
    used: bool = False

    def allocate(self, size: int) -> _Block:
        """A block of ``size`` bytes: the best-fitting free one, split, or a new segment."""
        free = [
            (block.size, index, position)
            for index, segment in enumerate(self.segments)
            for position, block in enumerate(segment)
            if block.free and block.size >= size
        ]
        if not free:
            block = _Block(size, free=False)
            self.segments.append([block])
            return block
        _, index, position = min(free)
        segment = self.segments[index]
        block = segment[position]
        if block.size > size:
            segment.insert(position + 1, _Block(block.size - size, free=True))
            block.size = size
        block.free = False
        return block

    def release(self, block: _Block) -> None:
        """Free ``block``, merged with the free blocks beside it in its segment."""
        block.free = True
        for segment in self.segments:
            if any(held is block for held in segment):
                merged: list[_Block] = []
                for held in segment:
                    if merged and merged[-1].free and held.free:
                        merged[-1].size += held.size
                    else:
                        merged.append(held)
                segment[:] = merged
                return

    @property
    def reserved(self) -> int:
        """Bytes of every segment."""
        return sum(block.size for segment in self.segments for block in segment)


class SimulatedGraphs:
    """A graph backend that serves CPU tensors by replaying the operators a capture recorded.

    A replay runs no Python of the captured function (:mod:`layergraph.tape`): what ran on
    the host at capture (hooks, values read, fields filled in) stays as it was then, as on a
    GPU.

    Costs, which the runner measures to choose how each batch size is served
    (:mod:`layergraph.serving.policy`), are wall-clock time for eager calls and nothing for replays,
    unless given: ``eager_ms(rows)`` and ``replay_ms(rows)`` make them a function of the batch,
    so that a test decides which way wins.

    Memory: a capture allocates, in its pool, ``working_set`` blocks of its outputs' bytes (its
    intermediates: a tower's layers hold several tensors about the size of its hidden state),
    then its outputs (one block per output storage), then frees the intermediates; the
    outputs' blocks are freed when the graph is collected.
    :meth:`pool_bytes` is what the pool reserved. With the default ``working_set`` of 0 a pool
    holds the outputs of its graphs, and of graphs dropped unless later captures reused their
    blocks. With ``strict`` (the default) a capture fails with
    :class:`CaptureUnsafeOperation` for what a CUDA stream capture refuses (the module
    docstring lists it), raised as the cause of a
    :class:`~layergraph.graphs.GraphCaptureError`; warm-up runs, like a GPU's, may do
    anything. Without ``strict`` the capture records what runs and refuses nothing; a value
    read on the host stays baked into the replay.
    """

    device_type = "cpu"

    def __init__(
        self,
        eager_ms: Callable[[int], float] | None = None,
        replay_ms: Callable[[int], float] | None = None,
        *,
        strict: bool = True,
        working_set: int = 0,
    ) -> None:
        self.captures = 0
        self.replays = 0
        self.memory_releases = 0
        self.eager_ms = eager_ms
        self.replay_ms = replay_ms
        self.strict = strict
        self.working_set = working_set

    def unavailable_reason(self) -> str | None:
        return None

    def is_capturing(self) -> bool:
        return False

    def new_pool(self) -> _SimulatedPool:
        return _SimulatedPool()

    def capture(
        self, fn: Callable[[], Any], pool: _SimulatedPool, warmup_runs: int
    ) -> tuple[Any, Any]:
        """Warm up, then "capture" ``fn``.

        Raises if ``pool`` was used and none of its graphs lives any more: PyTorch's allocator
        refuses that capture whenever memory of the pool is still held. Raises
        :class:`~layergraph.graphs.GraphCaptureError`, the error chained, if ``fn`` raises in
        the capture after its warm-up runs did not; the failed capture leaves the pool as it
        was, as a GPU backend's does.
        """
        for _ in range(warmup_runs):
            fn()
        if pool.used and not pool.graphs:
            raise RuntimeError("capture into a pool whose graphs were all released")
        recorder = Recorder(_refuse_unsafe if self.strict else None)
        try:
            with contextlib.ExitStack() as rules:
                if self.strict:
                    rules.enter_context(_HostReadRules())
                rules.enter_context(_stream_capturing())
                rules.enter_context(recorder)
                output = fn()
        except Exception as error:
            raise GraphCaptureError.caused_by(error) from error
        pool.used = True
        graph = _SimulatedGraph(recorder.tape(), output)
        sizes = _storage_bytes(output)
        intermediates = [pool.allocate(sum(sizes)) for _ in range(self.working_set if sizes else 0)]
        blocks = [pool.allocate(size) for size in sizes]
        for block in intermediates:
            pool.release(block)
        for block in blocks:
            weakref.finalize(graph, pool.release, block)
        pool.graphs.add(graph)
        self.captures += 1
        return graph, output

    def replay(self, graph: _SimulatedGraph) -> None:
        """Run the operators the capture recorded on the storages they used; no Python of the
        captured function runs."""
        with torch.inference_mode():  # a real replay writes its buffers in any grad mode
            graph.tape.replay()
        self.replays += 1

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, MemoryError) or "out of memory" in str(error)

    def release_memory(self) -> None:
        self.memory_releases += 1

    def time_eager(self, fn: Callable[[], Any], rows: int) -> tuple[Any, float]:
        started = time.perf_counter()
        result = fn()
        elapsed = (time.perf_counter() - started) * 1e3
        return result, elapsed if self.eager_ms is None else self.eager_ms(rows)

    def time_replay(self, fn: Callable[[], Any], rows: int) -> float:
        """The replay's cost; ``fn`` is not run (it would only write the same values again)."""
        return 0.0 if self.replay_ms is None else self.replay_ms(rows)

    def follow(self, previous: Any) -> None:
        return None

    def pool_bytes(self, pool: _SimulatedPool) -> int:
        return pool.reserved


def _storage_bytes(output: Any) -> list[int]:
    """Bytes of each distinct storage among the tensors of ``output``."""
    storages = {}
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return [size for size in storages.values() if size]


# ---- the pytest plugin for adapter authors ---------------------------------------------------


@dataclass(frozen=True)
class AdapterCheck:
    """What :func:`check_adapter` saw: the wrapper, the errors against eager, the stats."""

    graphed: Any
    eager_error: float
    graph_error: float | None
    """Relative error of graph replays against eager; ``None`` when no graph could run."""


def check_adapter(
    model: Any,
    adapter: Any,
    make_inputs: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]],
    *,
    batch_sizes: tuple[int, ...] = (1, 3),
    tolerance: float | None = None,
    **options: Any,
) -> AdapterCheck:
    """Wrap ``model`` with ``adapter`` and compare it with the unwrapped model.

    ``make_inputs(batch)`` returns fresh ``(args, kwargs)`` for one call. Everywhere: the
    wrapper's eager path must equal the model. On the CPU the graph logic runs through
    :class:`SimulatedGraphs` (keys, padding, per-key state such as attention metadata); on a
    GPU through real CUDA graphs. Every batch size in ``batch_sizes`` is checked, and the
    largest bucket captured is the next power of two, so odd sizes are padded. Raises
    ``AssertionError`` naming the batch size and the error beyond ``tolerance`` (relative error;
    ``None`` takes :data:`~layergraph.validation.DEFAULT_TOLERANCE` for the output dtype).
    """
    from .module import wrap
    from .validation import DEFAULT_TOLERANCE, first_tensor, relative_error

    cuda = torch.cuda.is_available() and any(
        p.is_cuda for p in itertools.chain(model.parameters(), model.buffers())
    )
    buckets = sorted({1 << (b - 1).bit_length() for b in batch_sizes})
    calls = [make_inputs(batch) for batch in batch_sizes]
    with torch.inference_mode():
        expected = [first_tensor(model(*args, **kwargs)) for args, kwargs in calls]
        eager = wrap(model, adapter, batch_sizes=buckets, lazy=False, **options)
        eager_error = max(
            relative_error(first_tensor(eager(*args, **kwargs)), want)
            for (args, kwargs), want in zip(calls, expected)
        )
        eager.unwrap()
        backend = None if cuda else SimulatedGraphs()
        graphed = wrap(model, adapter, batch_sizes=buckets, backend=backend, **options)
        graph_errors = [
            relative_error(first_tensor(graphed(*args, **kwargs)), want)
            for (args, kwargs), want in zip(calls, expected)
        ]
    limit = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(expected[0].dtype, 1e-4)
    assert eager_error <= limit, f"eager path differs from the model: {eager_error:.3g} > {limit}"
    for batch, error in zip(batch_sizes, graph_errors):
        assert error <= limit, f"batch {batch}: graph differs from eager: {error:.3g} > {limit}"
    stats = graphed.stats
    assert stats.eager_total == 0, f"calls ran eagerly: {dict(stats.eager_calls)}"
    return AdapterCheck(graphed, eager_error, max(graph_errors))


with contextlib.suppress(ImportError):  # the fixtures, where pytest is installed, for a
    # conftest that lists this module in ``pytest_plugins``
    from layergraph_pytest import layergraph_registry, register_adapter
