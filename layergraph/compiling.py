"""torch.compile for ``wrap``'s compiled layers and compiled region: recompile room and budget.

What ``compile_layers`` and ``compile_region`` call is the compiled code wrapped by
:func:`compiled_call`, which gives Dynamo room for one compiled version per shape
(:data:`RECOMPILE_LIMIT`) and charges the time spent compiling to a :class:`CompileBudget`;
:func:`compile_layers_in_place` and :func:`compiled_region` make a plan's compiled layers or
region. It does not choose which a model gets; ``wrap``'s options do.

Compiled layers are compiled with dynamic shapes (``dynamic=True``): one compiled version
serves every batch size and token budget, where the layer's code takes the same path for
each (Dynamo keeps a size of 1 apart, so a tower called with one image and with several has
two). The compiled region is compiled per shape, as its convolutions and pooling are. Both
compile through a :class:`RecordedBackend`, whose compiled graphs a simulated capture
(:class:`~layergraph.testing.SimulatedGraphs`) records as one step each, so that the CPU replay
runs the compiled kernels as a CUDA graph's does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from .adapter import CapturePlan
from .ledger import ChangeLedger
from .tape import function_modes_aside, run_as_one_step
from .warn import warn

__all__ = [
    "RECOMPILE_LIMIT",
    "CompileBudget",
    "CompileBudgetSpent",
    "CompiledSwitch",
    "LayerCompileSetting",
    "RecordedBackend",
    "compile_layers_in_place",
    "compile_options",
    "compiled_call",
    "compiled_region",
    "measured_compile",
]

LayerCompileSetting = bool | Literal["auto"] | dict[str, Any]
"""What ``wrap``'s ``compile_layers`` takes: ``"auto"`` (measured, in the background, where
graphs are CUDA graphs), ``True`` or a dict of ``torch.compile`` options (compiled before
the first capture, used for every key; ``{"auto": True, ...}`` measured with those options on
any backend), or ``False``."""

RECOMPILE_LIMIT = 64
"""How many compiled versions of one code object Dynamo may keep for compiled layers or a
compiled region.

PyTorch's default (8) is soon reached: every layer of a tower shares one forward, each batch
size is a shape, and a capture (on static buffers) and an eager call under inference mode are
two versions of one shape. Past the limit Dynamo stops compiling that code for good, and later
graphs would hold the slow kernels without saying so.
"""


class CompileBudgetSpent(UserWarning):
    """Warned once per wrapped model when its compile budget is spent."""


class CompileBudget:
    """The seconds one wrapped model's compiled code may spend compiling, over all its shapes.

    Every call of compiled code during which Dynamo compiled (a shape seen for the first time)
    is charged its whole duration. Once the total reaches ``seconds``, calls whose shape has
    compiled code still run it, and calls of other shapes run uncompiled
    (``torch.compiler.set_stance("eager_on_recompile")``): their graphs hold the model's own
    kernels. A compilation under way is not interrupted, so the total may pass ``seconds`` by
    one compilation. Compilations by other threads at the same moment are charged too.
    ``seconds=None`` sets no limit and only counts.
    """

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is not None and not seconds >= 0:
            raise ValueError(f"compile_budget must be a number of seconds >= 0, got {seconds!r}")
        if seconds is not None and not hasattr(torch.compiler, "set_stance"):
            raise RuntimeError(
                "compile_budget needs torch.compiler.set_stance (torch 2.6 or later)"
            )
        self.seconds = seconds
        self.spent = 0.0
        """Seconds charged so far."""
        self._warned = False

    @property
    def exhausted(self) -> bool:
        """Whether shapes without compiled code now run uncompiled."""
        return self.seconds is not None and self.spent >= self.seconds

    def run(self, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``compiled``, charging its duration if Dynamo compiled during the call."""
        if self.exhausted:
            self._warn_once()
            with torch.compiler.set_stance("eager_on_recompile"):
                return compiled(*args, **kwargs)
        frames = torch._dynamo.utils.counters["frames"]
        before = frames["total"]
        started = time.perf_counter()
        try:
            return compiled(*args, **kwargs)
        finally:
            if frames["total"] != before:
                self.spent += time.perf_counter() - started

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            warn(
                f"compile budget of {self.seconds:g} s spent ({self.spent:.1f} s): shapes not "
                f"compiled yet run and are captured uncompiled",
                CompileBudgetSpent,
            )


def compiled_call(compiled: Callable[..., Any], budget: CompileBudget) -> Callable[..., Any]:
    """``compiled`` called with Dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT`,
    its compile time charged to ``budget``.

    The limit is raised for the duration of each call only, and never lowered.
    """
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    def run(*args: Any, **kwargs: Any) -> Any:
        room = config.patch({name: max(getattr(config, name), RECOMPILE_LIMIT)})
        with room, function_modes_aside():
            return budget.run(compiled, *args, **kwargs)

    return run


def compile_options(setting: bool | dict[str, Any], dynamic: bool = False) -> dict[str, Any]:
    """``torch.compile`` keyword arguments for ``compile_layers`` (``dynamic`` ``True``) or
    ``compile_region`` (``False``, the default, as this function's one-argument form always
    gave): the setting's own where it is a dict."""
    return {"dynamic": dynamic, **(setting if isinstance(setting, dict) else {})}


def measured_compile(setting: LayerCompileSetting, device_type: str) -> dict[str, Any] | None:
    """The ``torch.compile`` options of compiled layers chosen per graph key by measurement
    (:class:`~layergraph.serving.fusion.LayerFusion`), or ``None`` where ``setting`` compiles
    always or never: ``"auto"`` is measured with Inductor where graphs are CUDA graphs
    (``device_type`` ``"cuda"``) and off elsewhere (and before PyTorch 2.6, which cannot keep
    a call from compiling); a dict with ``"auto": True`` is measured with its other options on
    any backend."""
    staged = hasattr(torch.compiler, "set_stance")  # what keeps calls from compiling
    if setting == "auto":
        return {} if device_type == "cuda" and staged else None
    if isinstance(setting, dict) and setting.get("auto"):
        if not staged:
            raise RuntimeError("compile_layers with 'auto' needs torch 2.6 or later")
        return {name: value for name, value in setting.items() if name != "auto"}
    return None


def compile_layers_in_place(
    plan: CapturePlan,
    adapter_name: str,
    setting: bool | dict[str, Any],
    budget: CompileBudget,
    changes: ChangeLedger,
    switch: CompiledSwitch | None = None,
) -> None:
    """Compile the plan's layers in place (regional compilation), each a recorded change
    (``compile_layers``); nothing for ``setting`` ``False``. With a ``switch``, a layer's
    calls run its compiled code only where the switch is on, its own code elsewhere."""
    if setting is False:
        return
    layers = plan.layers()
    if not layers:
        raise ValueError(
            f"compile_layers needs the model's repeated layers, which the {adapter_name!r} "
            f"adapter does not name"
        )
    options = _recorded(compile_options(setting, dynamic=True))  # one backend: code shared
    for layer in layers:
        compiled = compiled_call(torch.compile(_calling(layer), **options), budget)
        if switch is not None:
            compiled = switch.route(layer._call_impl, compiled)
        # What nn.Module.compile() sets: the module's calls go to the compiled function.
        changes.set_attribute(layer, "_compiled_call_impl", compiled, "compiled")


class CompiledSwitch:
    """Which code compiled layers run: their compiled code inside :meth:`on`, in that
    thread or task only (a context variable), the layers' own code everywhere else.

    What lets one model hold plain and compiled graphs side by side: a capture under
    :meth:`on` bakes in the compiled kernels, one outside it the layers as written, and eager
    calls run the layers as written. It does not decide which a key keeps
    (:class:`~layergraph.serving.fusion.LayerFusion` does)."""

    def __init__(self) -> None:
        self._on: contextvars.ContextVar[bool] = contextvars.ContextVar(
            "compiled_layers", default=False
        )

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """Run compiled layers' compiled code inside the block."""
        token = self._on.set(True)
        try:
            yield
        finally:
            self._on.reset(token)

    def route(self, plain: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
        """A function that calls ``compiled`` where the switch is on, else ``plain`` (a
        layer's own ``_call_impl``, a plan's region)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            return compiled(*args, **kwargs) if self._on.get() else plain(*args, **kwargs)

        return call


def _calling(layer: nn.Module) -> Callable[..., Any]:
    """A function that calls ``layer`` (hooks and forward), for torch.compile to trace.

    Compiling this function rather than the layer's own ``_call_impl`` (what
    ``nn.Module.compile()`` compiles) gives Dynamo a first frame outside ``torch.nn``, which
    some PyTorch versions (2.11, for one) skip for PyTorch's own layers
    (``nn.TransformerEncoderLayer``, say): those would run uncompiled without a word.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return layer._call_impl(*args, **kwargs)

    return call


def compiled_region(
    plan: CapturePlan, setting: bool | dict[str, Any], budget: CompileBudget
) -> Callable[..., Any] | None:
    """``plan.region`` compiled with torch.compile (``compile_region``), or ``None`` to
    capture it as it is."""
    if setting is False:
        return None
    options = _recorded(compile_options(setting))
    return compiled_call(torch.compile(plan.region, **options), budget)


def _recorded(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keyword arguments ``options`` with their backend (and its ``mode`` and
    ``options``) made into one :class:`RecordedBackend`."""
    rest = dict(options)
    backend, mode, settings = (rest.pop(name, None) for name in ("backend", "mode", "options"))
    settings = dict(settings) if settings else None
    # torch.compile's own setting among the backend's options stays torch.compile's.
    guard_filter = settings.pop("guard_filter_fn", None) if settings else None
    dynamic = rest.get("dynamic")
    if backend in (None, "inductor"):
        inner = torch._TorchCompileInductorWrapper(mode, settings, dynamic)
    else:
        inner = torch._TorchCompileWrapper(backend, mode, settings, dynamic)
    if guard_filter is not None:
        rest["options"] = {"guard_filter_fn": guard_filter}
    return {**rest, "backend": RecordedBackend(inner)}


class RecordedBackend:
    """A ``torch.compile`` backend that compiles as ``inner`` does and whose compiled graphs a
    simulated capture (:class:`~layergraph.testing.SimulatedGraphs`) records as one step each
    (:func:`~layergraph.tape.run_as_one_step`), so that its replay runs the compiled kernels
    and nothing else, as a CUDA graph does: not the Python around them (guards, the model's
    side effects), whose operators between compiled graphs it records one by one."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        compiled = self.inner(graph, example_inputs, **kwargs)
        return functools.partial(run_as_one_step, compiled)

    def __getattr__(self, name: str) -> Any:
        # What Dynamo reads of a backend (compiler_name, get_compiler_config, reset) is inner's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
