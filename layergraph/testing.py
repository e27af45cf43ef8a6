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
waits for the GPU, and a tensor made on the host during the capture (``torch.arange(n)``
without ``device=``) that reaches the device: an index of a device's tensor, ``.to(device)``,
an operand beside the device's tensors (a copy from pageable host memory, which a capture
refuses). Which tensors are the host's is tracked as :class:`_CaptureRules` says; values of
the host's tensors may be read, as a GPU's host reads them. Its pools model the memory a
CUDA caching allocator reserves for graphs (:class:`_SimulatedPool`), so that tests can check
how captures share a pool; it does not simulate kernels' timing or streams.
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
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils import _pytree as pytree
from torch.utils._device import DeviceContext

from .device_factories import COMPUTED_FACTORIES, HOST_COPY_MESSAGE, MadeOnDevice
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


def _refuse_unsafe(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_host: Callable[[Any], bool] = lambda value: False,
) -> None:
    """Raise :class:`CaptureUnsafeOperation` for an operator a CUDA stream capture refuses:
    :data:`_UNSAFE`, indexing by a boolean mask (``x[mask]``, ``x[mask] = y``), a masked fill
    with the value of a device's tensor (pass a number), and ``repeat_interleave`` with tensor
    repeats and no ``output_size``. ``on_host(value)`` says whether a tensor is the host's."""
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
        and not on_host(args[2] if len(args) > 2 else kwargs.get("value"))
    ):
        why = "fills with a device tensor's value, which CUDA's kernel reads on the host"
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
them without reaching :func:`_refuse_unsafe`, so :class:`_CaptureRules` sees them first."""

_HOST_FACTORIES = COMPUTED_FACTORIES | {
    torch.as_tensor,
    torch.rand,
    torch.randint,
    torch.randn,
    torch.randperm,
    torch.scalar_tensor,
    torch.tensor,
}
"""Factories that make their tensor on the host unless given ``device=``."""

_INDEXING = frozenset(
    {
        torch.Tensor.__getitem__,
        torch.Tensor.__setitem__,
        torch.Tensor.index_put,
        torch.Tensor.index_put_,
        torch.index_put,
    }
)
"""Functions that copy index tensors of the host to the device, whatever their size."""

_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_})
"""Methods that copy a host tensor to the device when given a device or a device's tensor."""


class _CaptureRules(TorchFunctionMode):
    """Raises :class:`CaptureUnsafeOperation` for what a CUDA capture refuses at the level of
    PyTorch's functions: a device tensor's value read on the host, and a tensor made on the
    host during the capture copied to the device.

    A tensor is the host's if the capture made it with a factory of :data:`_HOST_FACTORIES`
    that makes it there (:func:`_factory_on_host`), or from the host's tensors alone; every other
    tensor (parameters, inputs, what derives from them) is the device's. A function of the
    host's tensors alone runs as the CPU would run it on a GPU's host: its values may be read,
    and :meth:`check` lets its operators through. Tensors made on the host before the capture
    (in a warm-up run, kept in a cache) count as the device's.
    """

    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}
        self._on_host = False

    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """:func:`_refuse_unsafe`, except within a function of the host's tensors alone."""
        if not self._on_host:
            _refuse_unsafe(func, args, kwargs, self._is_host)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        host = [tensor for tensor in tensors if self._is_host(tensor)]
        on_device = len(host) < len(tensors)
        if host:
            copied = _copied_to_device(func, args, kwargs, host, on_device)
            if copied:
                raise CaptureUnsafeOperation(
                    f"{_name(func)} copies {copied} made on the host during the capture (made "
                    f"without device=) to the device: {HOST_COPY_MESSAGE}; make it with "
                    f"device=, or before the captured region"
                )
        elif _reads_host(func):
            raise CaptureUnsafeOperation(
                f"Tensor.{func.__name__} reads a tensor's value on the host (.item(), bool(t), "
                f"int(t)): a CUDA graph cannot capture it (it waits for the GPU); compute it "
                f"before the captured region, or pass the result in as an input"
            )
        made_on_host = _factory_on_host(func, kwargs) or (
            host and not on_device and func not in _MOVES
        )
        was_on_host, self._on_host = self._on_host, bool(made_on_host)
        try:
            result = func(*args, **kwargs)
        finally:
            self._on_host = was_on_host
        if made_on_host:
            for leaf in pytree.tree_leaves(result):
                if isinstance(leaf, torch.Tensor):
                    self._host[id(leaf)] = weakref.ref(leaf)
        return result

    def _is_host(self, value: Any) -> bool:
        held = self._host.get(id(value))
        return held is not None and held() is value


def _copied_to_device(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], host: list[Any], on_device: bool
) -> str | None:
    """What of ``host``, tensors made on the host that ``func`` took, it would copy to the
    device (``None`` for nothing): indices, a tensor moved, or a tensor beside the device's
    (a tensor of no dimensions stands for a number there, as CUDA's kernels take it)."""
    if func in _MOVES:
        targets = [*args[1:], kwargs.get("device")]
        moved = (
            func is torch.Tensor.cuda
            or on_device
            or any(
                isinstance(target, torch.device) or (isinstance(target, str) and target != "cpu")
                for target in targets
            )
        )
        return "a tensor" if moved else None
    if not on_device:
        return None
    if func in _INDEXING:
        return "an index tensor"
    if any(tensor.dim() > 0 for tensor in host):
        return "a tensor"
    return None


def _factory_on_host(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` is a factory that makes its tensor on the host: one of
    :data:`_HOST_FACTORIES` given no ``device=`` (or ``"cpu"``), unless a context outside the
    capture gives it one (``with torch.device(...)``, or :class:`MadeOnDevice` for the
    factories it moves)."""
    device = kwargs.get("device")
    if func not in _HOST_FACTORIES or (device is not None and device != "cpu"):
        return False
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, DeviceContext) or (
            isinstance(mode, MadeOnDevice)
            and func in COMPUTED_FACTORIES
            and not kwargs.get("pin_memory")
        ):
            return False
    return True


def _reads_host(func: Any) -> bool:
    return getattr(func, "__name__", None) in _HOST_READS and "Tensor" in getattr(
        func, "__qualname__", ""
    )


def _name(func: Any) -> str:
    owner = "Tensor." if "Tensor" in getattr(func, "__qualname__", "") else "torch."
    return owner + getattr(func, "__name__", str(func))


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
    so that a test decides which way wins; ``compiled_replay_ms(rows)``, where given, is the
    cost of a replay of a graph that runs compiled code (``compile_layers``), and such a timed
    replay runs.

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
        compiled_replay_ms: Callable[[int], float] | None = None,
        strict: bool = True,
        working_set: int = 0,
    ) -> None:
        self.captures = 0
        self.replays = 0
        self.memory_releases = 0
        self.eager_ms = eager_ms
        self.replay_ms = replay_ms
        self.compiled_replay_ms = compiled_replay_ms
        self._replayed: _SimulatedGraph | None = None
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
        the capture after its warm-up runs did not; the failed capture leaves no graph in the
        pool, as a GPU backend's does, but counts as its use: a pool whose only capture failed
        takes no other (on a GPU, the failed capture's tensors that the traceback holds keep
        its memory, and PyTorch asserts at the next capture into it).
        """
        for _ in range(warmup_runs):
            fn()
        if pool.used and not pool.graphs:
            raise RuntimeError("capture into a pool whose graphs were all released")
        pool.used = True
        capture_rules = _CaptureRules() if self.strict else None
        recorder = Recorder(capture_rules.check if capture_rules is not None else None)
        try:
            with contextlib.ExitStack() as rules:
                if capture_rules is not None:
                    rules.enter_context(capture_rules)
                rules.enter_context(_stream_capturing())
                rules.enter_context(recorder)
                output = fn()
        except Exception as error:
            raise GraphCaptureError.caused_by(error) from error
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
        self._replayed = graph

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
        """The replay's cost; ``fn`` is not run (it would only write the same values again),
        unless ``compiled_replay_ms`` is given, to tell which graph it replays."""
        if self.compiled_replay_ms is not None:
            fn()
            if self._replayed is not None and self._replayed.tape.one_steps:
                return self.compiled_replay_ms(rows)
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
