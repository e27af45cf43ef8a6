"""A record of the operators a capture ran, replayed on the storages it ran them on.

What :class:`~layergraph.testing.SimulatedGraphs` replays on the CPU in place of a CUDA graph.
A CUDA graph records kernels, each bound to the device addresses it read and wrote at capture;
a replay launches them again and runs no Python: not the model's, not its hooks', not
layergraph's. :class:`Tape` keeps that contract with PyTorch's operators for kernels:

- :class:`Recorder`, a ``TorchDispatchMode``, sees every ATen operator the captured function
  runs (and every custom operator, such as layergraph's Triton kernels, as one), with the
  tensors it reads and writes;
- :meth:`Tape.replay` runs those operators again, in order, on the same storages: the output
  of a functional operator is written into the storage it had at capture, an in-place or
  ``out=`` operator writes the tensors it wrote then, a view is taken again of the storage it
  viewed. Python values read at capture (shapes, a value read on the host, a Python number an
  operator took) stay as they were then;
- :func:`run_as_one_step` records a call of a compiled graph (``wrap``'s compiled layers or
  region) as one step, as a custom operator is one: Inductor's kernels run outside ATen's
  dispatcher, so a recorder would see some of their work (an external matrix product) and
  miss the rest (the fused kernels), and a replay would hand on stale values. A replay calls
  the compiled graph again on the captured storages, as a CUDA graph launches its kernels
  again; the Python around it (Dynamo's guards, the model's side effects) ran at capture only.

Tensors from before the capture (parameters, the runner's static buffers) are held by their
storage at capture: a tensor given a new storage since (``p.data = t``) is not seen, as a GPU
would keep reading the old address. Storages the capture made that nothing outside the tape
still holds are its temporaries: made again at each replay and dropped after, as a graph's
pool reuses their memory. What is not simulated: kernels' own timing and streams; a CPU
operator that a GPU model would have run on the host (it is replayed here); memory shared
between graphs of one pool (each tape keeps its own storages).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import overrides
from torch.utils import _python_dispatch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Recorder", "Tape", "function_modes_aside", "run_as_one_step"]

_NO_KERNEL = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
"""Operators that allocate and launch no kernel: a replay writes nothing into what they made."""

_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
"""Tensor types recorded as they come; any other type is a subclass that unwraps itself."""


@dataclass(frozen=True)
class _Made:
    """A tensor the capture made: its index among the tape's, where a replay keeps it."""

    index: int


@dataclass(eq=False)
class _Step:
    """One operator of the capture: what it was called with (tensors the capture made as
    :class:`_Made`, others as aliases of their storage at capture) and the index of each tensor
    it returned (``None`` for a value that is not a tensor)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int | None, ...]
    fresh: tuple[bool, ...]
    """Per output, whether it had a storage of its own at capture (no input's storage)."""
    runs: bool
    """Whether a replay runs it: it launches a kernel and returns a tensor or writes one."""
    one_step: bool = False
    """Whether it is a call recorded as one step (:func:`run_as_one_step`)."""


Check = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]
"""Called with each operator and its arguments before it runs; raises to refuse it."""


class Recorder(TorchDispatchMode):
    """Records the operators run under it into a :class:`Tape` (:meth:`tape`).

    ``check(func, args, kwargs)``, when given, runs before each operator and may raise, to
    refuse what a capture refuses.
    """

    def __init__(self, check: Check | None) -> None:
        super().__init__()
        self._check = check
        self._steps: list[_Step] = []
        self._made: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        """Tape index by ``id`` of each tensor made (held in ``_made`` while recording, so no
        id is reused)."""
        self._outside: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """By ``id``: a tensor from before the capture, and the alias of its storage that the
        tape holds."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(kind not in _PLAIN for kind in types):
            # A tensor subclass (a DTensor, a quantized weight) unwraps itself first; the
            # operators it runs on its plain tensors come back here.
            return NotImplemented
        kwargs = kwargs or {}
        if self._check is not None:
            self._check(func, args, kwargs)
        result = func(*args, **kwargs)
        if all(type(leaf) in _PLAIN for leaf in pytree.tree_leaves(result) if _is_tensor(leaf)):
            # An operator that wraps its result in a subclass (a collective's waiting tensor)
            # is not recorded: the work it stands for is in the operators it ran.
            self._record(func, args, kwargs, result)
        return result

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo runs compiled code under a recorder (it would run the original Python under
        any other dispatch mode); each compiled graph records itself as one step
        (:class:`~layergraph.compiling.RecordedBackend`), and the operators between them are
        recorded one by one."""
        return True

    def record_call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        """Record a call of ``fn`` that ran outside the recorder as one step
        (:func:`run_as_one_step`)."""
        self._record(fn, args, kwargs, result, one_step=True)

    def _record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        one_step: bool = False,
    ) -> None:
        inputs = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if _is_tensor(leaf)]
        read = {_storage(tensor) for tensor in inputs}
        held_args = pytree.tree_map(self._reference, args)
        held_kwargs = pytree.tree_map(self._reference, kwargs)
        outputs: list[int | None] = []
        fresh: list[bool] = []
        for leaf in pytree.tree_leaves(result):
            if not _is_tensor(leaf):
                outputs.append(None)
                fresh.append(False)
                continue
            outputs.append(self._add(leaf))
            fresh.append(leaf.numel() > 0 and _storage(leaf) not in read)
        schema = getattr(func, "_schema", None)
        if schema is None:  # a higher-order operator: it runs whatever it took
            runs = True
        else:
            writes = any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
            )
            makes = any(index is not None for index in outputs)
            runs = schema.name not in _NO_KERNEL and (writes or makes)
        step = _Step(func, held_args, held_kwargs, tuple(outputs), tuple(fresh), runs, one_step)
        self._steps.append(step)

    def _add(self, tensor: torch.Tensor) -> int:
        index = self._index.get(id(tensor))
        if index is None:
            index = self._index[id(tensor)] = len(self._made)
            self._made.append(tensor)
        return index

    def _reference(self, value: Any) -> Any:
        """``value`` as a step holds it: a made tensor by index, another by its storage."""
        if not _is_tensor(value):
            return value
        index = self._index.get(id(value))
        if index is not None:
            return _Made(index)
        held = self._outside.get(id(value))
        if held is None:
            held = self._outside[id(value)] = (value, value.detach())
        return held[1]

    def tape(self) -> Tape:
        """The tape of what ran; the recorder lets go of every tensor it made, and the tape
        keeps those whose storage something outside it still holds (:class:`Tape`)."""
        shapes = [_layout(tensor) for tensor in self._made]
        alive = [weakref.ref(tensor) for tensor in self._made]
        steps, self._steps, self._made = self._steps, [], []
        self._index, self._outside = {}, {}
        storages: dict[int, torch.UntypedStorage] = {}
        for ref in alive:
            tensor = ref()
            if tensor is not None and _storage(tensor):
                storages[_storage(tensor)] = tensor.untyped_storage()
        return Tape(steps, shapes, storages)


@contextlib.contextmanager
def function_modes_aside() -> Iterator[None]:
    """Where a :class:`Recorder` is the innermost dispatch mode, every torch function mode (a
    simulated capture's rules) set aside for the duration; nothing elsewhere.

    For compiled code run under a recorder: Dynamo traces the function modes on the stack into
    what it compiles and guards on what they read, so it would compile again at every capture.
    """
    with contextlib.ExitStack() as aside:
        if isinstance(_python_dispatch._get_current_dispatch_mode(), Recorder):
            _pop_function_modes(aside)
        yield


def _pop_function_modes(stack: contextlib.ExitStack) -> None:
    """Every torch function mode popped until ``stack`` closes."""
    for _ in range(len(overrides._get_current_function_mode_stack())):
        stack.enter_context(overrides._pop_mode_temporarily())


def run_as_one_step(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; where a :class:`Recorder` is the innermost dispatch mode, run
    with the recorder set aside and recorded as one step, which a replay runs again.

    For a compiled graph, whose kernels a recorder cannot see. Function modes (a simulated
    capture's rules) are set aside too; what runs inside ``fn`` is not checked against them.
    The step's outputs are written into their captured storages at replay like an operator's.
    """
    if not isinstance(_python_dispatch._get_current_dispatch_mode(), Recorder):
        return fn(*args, **kwargs)
    with contextlib.ExitStack() as aside:
        recorder = aside.enter_context(_python_dispatch._pop_mode_temporarily())
        _pop_function_modes(aside)
        result = fn(*args, **kwargs)
    captured = contextvars.copy_context()

    def again(*args: Any, **kwargs: Any) -> Any:
        # In the capture's context variables: an opaque operator inside a compiled graph
        # (opaque_attention) reads the state bound then, as the kernels a GPU's graph holds do.
        return captured.copy().run(fn, *args, **kwargs)

    recorder.record_call(again, args, kwargs, result)
    return result


class Tape:
    """The operators of one capture, replayed on its storages (the module docstring).

    Made tensors whose storage outlives the recording (the capture's outputs, a tensor a hook
    kept, a view of either) are kept, rebuilt on that storage with their capture's shape,
    strides and offset; the rest are temporaries of each replay.
    """

    def __init__(
        self,
        steps: list[_Step],
        layouts: list[_Layout],
        storages: dict[int, torch.UntypedStorage],
    ) -> None:
        self._steps = steps
        self._layouts = layouts
        self._kept: dict[int, torch.Tensor] = {}
        for step in steps:
            for index, fresh in zip(step.outputs, step.fresh):
                if index is None or not fresh:
                    continue
                layout = layouts[index]
                storage = storages.get(layout.storage)
                if storage is not None:
                    self._kept[index] = layout.on(storage)

    @property
    def operators(self) -> int:
        """How many operators a replay runs."""
        return sum(step.runs for step in self._steps)

    @property
    def one_steps(self) -> int:
        """How many calls recorded as one step (compiled graphs) a replay runs."""
        return sum(step.one_step for step in self._steps)

    @property
    def kept(self) -> int:
        """How many tensors the capture made are kept past it (the rest are temporaries)."""
        return len(self._kept)

    def replay(self) -> None:
        """Run the recorded operators again on the captured storages."""
        values: dict[int, Any] = dict(self._kept)
        for step in self._steps:
            if not step.runs:
                for index in step.outputs:
                    if index is not None and index not in values:
                        values[index] = self._layouts[index].empty()
                continue
            args = _resolve(step.args, values)
            kwargs = _resolve(step.kwargs, values)
            result = step.func(*args, **kwargs)
            for index, fresh, value in zip(step.outputs, step.fresh, pytree.tree_leaves(result)):
                if index is None:
                    _finish(value)
                    continue
                kept = self._kept.get(index) if fresh else None
                if kept is not None:
                    kept.copy_(value)
                else:
                    values[index] = value


@dataclass(frozen=True)
class _Layout:
    """Where a made tensor lay at capture: its storage, offset, shape, strides and dtype."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A tensor of this layout on ``storage``."""
        tensor = torch.empty((0,), dtype=self.dtype, device=self.device)
        return tensor.set_(storage, self.offset, self.shape, self.stride)

    def empty(self) -> torch.Tensor:
        """A new tensor of this layout's shape, strides and dtype, its values unset."""
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


def _layout(tensor: torch.Tensor) -> _Layout:
    return _Layout(
        _storage(tensor),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )


def _resolve(value: Any, values: dict[int, Any]) -> Any:
    return pytree.tree_map(
        lambda leaf: values[leaf.index] if isinstance(leaf, _Made) else leaf, value
    )


def _finish(value: Any) -> None:
    """Wait for a collective's work handle, as the stream order of a real replay does."""
    wait = getattr(value, "wait", None)
    if callable(wait):
        wait()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
