"""``wrap`` and the module it returns."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import inspect
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

from torch import nn

from .adapter import Adapter, AdapterMismatch, CapturePlan, PlanContext, make_plan
from .compiling import (
    RECOMPILE_LIMIT,
    CompileBudget,
    LayerCompileSetting,
    compile_layers_in_place,
    compiled_region,
)
from .graphs import CudaGraphs, GraphBackend
from .guards import NoticeMoves
from .keys import ShapeKey
from .ledger import ChangeLedger, UndoError
from .multi_tower import SHARED_POOLS, GraphedTowers, find_towers, wrap_towers
from .plugins import AdapterRegistry, UnknownAdapterError, get_registry
from .runner import GraphInfo, GraphRunner, RunnerOptions
from .serving.fusion import LayerFusion
from .serving.pool import PoolShare
from .stats import GraphStats
from .warm_start import Measurements, load_warm_start, read_measurements, save_warm_start
from .warn import warn

__all__ = ["RECOMPILE_LIMIT", "GraphedModule", "unwrap", "wrap"]


def wrap(
    model: nn.Module,
    adapter: str | Adapter = "auto",
    *,
    batch_sizes: Sequence[int] | Literal["auto"] | None = "auto",
    lazy: bool = True,
    max_graphs: int | None = None,
    capture_after: int = 1,
    static_output: bool = False,
    validate: bool = False,
    tolerance: float | None = None,
    warmup_runs: int = 2,
    debug: bool = False,
    observe_calls: int | None = None,
    compile_layers: LayerCompileSetting = "auto",
    compile_region: bool | dict[str, Any] = False,
    compile_budget: float | None = None,
    warm_start: str | os.PathLike[str] | None = None,
    backend: GraphBackend | None = None,
    **adapter_options: Any,
) -> GraphedModule | GraphedTowers:
    """Wrap ``model`` so that its calls replay CUDA graphs, one per shape key.

    ``adapter`` is the name of a registered adapter (see :func:`layergraph.list_adapters`), an
    :class:`~layergraph.Adapter` instance, or ``"auto"`` (the default): the adapter that
    recognises the model, through the ``recognize_model`` hook; a model holding towers that
    different adapters serve (an Omni thinker's audio and vision towers), or towers in a model
    no adapter recognises, gets a :class:`~layergraph.multi_tower.GraphedTowers` instead, each
    tower served in place by its own adapter. Keyword options not listed
    here go to the adapter's constructor (for example ``stack="encoder.layers"`` for
    ``"sequential"``, ``attention="triton"`` for ``"internvl"``). The runner options are
    described in :class:`~layergraph.runner.RunnerOptions`; ``backend`` replaces the CUDA
    graph backend (tests use :class:`layergraph.testing.SimulatedGraphs`).

    ``compile_layers`` compiles each of the region's repeated layers with ``torch.compile``
    (dynamic shapes: one compiled version serves every batch size and token budget, the code
    shared between the layers), so that graphs replay fused kernels. ``"auto"`` (the default)
    decides per key by measurement on CUDA graphs: a key is served at once as built,
    ``capture()`` compiles the layers ahead (``{"auto": True, "background": True}``: a
    background thread), then a key is captured again with them and keeps the faster graph
    (:mod:`layergraph.serving.fusion`; ``stats.fusion`` says why; a model captured whole gets
    its region compiled per shape instead); eager calls run the model as built. ``True`` (or
    ``torch.compile``'s keyword arguments) compiles before the first capture, for every key and
    eager call; a dict with ``"auto": True`` is measured as ``"auto"`` is, with its options, on
    any backend. ``False`` compiles nothing. ``unwrap()`` removes the compilation.

    ``compile_region`` instead compiles the whole region a graph holds (embeddings, every layer,
    final norm and head) with ``torch.compile`` (``True``, or a dict of its keyword arguments;
    ``dynamic=False`` unless given), so that kernels fuse across layer boundaries too. It is
    used for warm-up and capture only: eager calls run the model as it is. It compiles once per
    shape, for longer than ``compile_layers`` (seconds to tens of seconds).

    ``compile_budget`` caps the seconds the compiled layers or region may spend compiling, over
    all shapes: once spent, shapes compiled before keep their compiled code and others are
    captured (and run) uncompiled, with a :class:`~layergraph.compiling.CompileBudgetSpent`
    warning; a compilation under way is not interrupted
    (:class:`~layergraph.compiling.CompileBudget`). ``None`` (the default) sets no cap.
    :attr:`GraphedModule.compile_budget` tells what was spent.

    ``warm_start`` names a file written by :meth:`GraphedModule.save_warm_start` in another
    process: Inductor's and Triton's caches are filled from it before anything compiles, so
    the compiled layers or region of shapes compiled there start without compiling kernels,
    and the shape policy starts from what was measured there (batch sizes whose graphs were
    slower than eager are neither captured nor compiled, those that pay are not measured
    again, and a packed model's learnt token budgets are chosen from the calls seen there, so
    its first call captures them) when the model, adapter and options are the same
    (:mod:`layergraph.warm_start`; a file made on another GPU or with other versions is not
    loaded, with a warning).

    Dynamo may keep :data:`~layergraph.compiling.RECOMPILE_LIMIT` compiled versions of the compiled
    layers or region (PyTorch's default, 8, is left as it is); further shapes run uncompiled.

    The model itself is not copied. Every change wrapping makes to it (a region routed to the
    graphs, rewrites, fused weights, compiled layers) is recorded in
    :attr:`GraphedModule.changes`; :meth:`GraphedModule.unwrap` undoes them all and returns
    the model as it was. If wrapping fails, the changes made so far are undone.
    """
    if isinstance(model, GraphedModule):
        raise TypeError("this model is already wrapped; unwrap() it first")
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() needs an nn.Module, got {type(model).__name__}")
    if _wrapper_of(model) is not None:
        gc.collect()  # a wrapper dropped but kept by a reference cycle is not live
    holder = _wrapper_of(model)
    if holder is not None:
        by = (
            f"the wrapper of adapter {holder.adapter.name!r}"
            if isinstance(holder, GraphedModule)
            else "a wrapper of its towers"
        )
        raise TypeError(
            f"this {type(model).__name__} is wrapped already (by {by}); use that wrapper, or "
            f"unwrap() it before wrapping again"
        )
    options = RunnerOptions(
        batch_sizes=batch_sizes,
        lazy=lazy,
        max_graphs=max_graphs,
        capture_after=capture_after,
        static_output=static_output,
        validate=validate,
        tolerance=tolerance,
        warmup_runs=warmup_runs,
        debug=debug,
        observe_calls=observe_calls,
    )
    registry = get_registry()
    if adapter == "auto" and SHARED_POOLS.get() is None:
        towers = find_towers(
            model,
            registry.dedicated,
            lambda name: (
                getattr(registry.factory(name), "inside_any_model", True)
                or registry.factory(name)().recognizes(model)
            ),
        )
        several_kinds = len(set(towers.values())) > 1
        if towers and (several_kinds or registry.dedicated(model) is None):
            settings = dict(
                vars(options),
                compile_layers=compile_layers,
                compile_region=compile_region,
                compile_budget=compile_budget,
            )
            if warm_start is not None:
                raise ValueError(
                    f"warm_start serves a wrapper of one tower; this {type(model).__name__} "
                    f"holds {len(towers)} ({', '.join(towers)}): wrap each for its own file"
                )
            backend = backend if backend is not None else CudaGraphs()

            def wrap_tower(part: nn.Module, name: str, options: dict[str, Any]) -> GraphedModule:
                return cast(GraphedModule, wrap(part, name, backend=backend, **settings, **options))

            factories = {path: registry.factory(name) for path, name in towers.items()}
            graphed_towers = wrap_towers(
                model, towers, factories, adapter_options, PoolShare(backend), wrap_tower
            )
            _WRAPPERS[model] = weakref.ref(graphed_towers)
            return graphed_towers
    always = compile_layers is True or (
        isinstance(compile_layers, dict) and not compile_layers.get("auto")
    )
    context = PlanContext(
        registry,
        compiled=always or compile_region is not False,
        part_planner=lambda part, options: _auto_plan(registry, part, dict(options), context),
    )
    if adapter == "auto":
        adapter_object, plan = _auto_plan(registry, model, adapter_options, context)
    elif isinstance(adapter, str):
        adapter_object = registry.create(adapter, adapter_options)
    elif isinstance(adapter, Adapter):
        if adapter_options:
            raise TypeError(
                f"unknown option(s) {', '.join(map(repr, adapter_options))}: options for an "
                f"adapter object go to its constructor"
            )
        adapter_object = adapter
    else:
        raise TypeError(
            f"adapter must be a registered adapter's name or an Adapter instance, "
            f"got {type(adapter).__name__}"
        )
    if always and compile_region is not False:
        raise ValueError("compile_layers and compile_region exclude each other: choose one")
    if compile_budget is not None and compile_layers is False and compile_region is False:
        raise ValueError("compile_budget limits compile_layers or compile_region: set one")
    fingerprint = _fingerprint(
        model, adapter_object, {**adapter_options, "compile": (compile_layers, compile_region)}
    )
    if warm_start is not None and not isinstance(warm_start, (str, os.PathLike)):
        raise TypeError(
            f"warm_start must be the path (a str or os.PathLike) of a file written by "
            f"save_warm_start, got {type(warm_start).__name__}"
        )
    if warm_start is not None:
        load_warm_start(warm_start)
    budget = CompileBudget(compile_budget)
    if adapter != "auto":
        plan = make_plan(adapter_object, model, context)
    changes = ChangeLedger(model)
    route = _Route()
    try:
        plan.change_model(changes, route)
        backend = backend if backend is not None else CudaGraphs()
        layer_setting = compile_layers if always else False
        compile_layers_in_place(plan, adapter_object.name, layer_setting, budget, changes)
        measured = None if always or compile_region is not False else compile_layers
        fusion = LayerFusion.of(plan, measured, backend.device_type, budget, changes)
        changes.apply(NoticeMoves(plan.owner))
        runner = GraphRunner(
            plan,
            options,
            backend,
            captured_region=compiled_region(plan, compile_region, budget)
            or getattr(fusion, "region", None),
            capture_contexts=functools.partial(registry.capture_contexts, model),
            eager_checks=registry.eager_checks(model),
            pools=SHARED_POOLS.get(),
            fusion=fusion,
        )
    except BaseException:
        changes.undo_all()
        raise
    route.target = route.runner = runner
    if warm_start is not None:
        measured = read_measurements(warm_start, fingerprint)
        if measured is not None:
            runner.seed(measured.costs, measured.token_totals, measured.token_budgets)
            if measured.plan_choices is not None:
                plan.take_measured_choices(measured.plan_choices)
    graphed = GraphedModule(
        model, adapter_object, plan, runner, changes, route, budget, fingerprint
    )
    _WRAPPERS[model] = weakref.ref(graphed)
    # A wrapper dropped without unwrap() leaves the model as unwrap() would.
    weakref.finalize(graphed, _undo_quietly, changes).atexit = False
    return graphed


def _undo_quietly(changes: ChangeLedger) -> None:
    """Undo ``changes`` of a wrapper that was collected; a change that cannot be undone is
    warned of, since no caller is there to take the error."""
    try:
        changes.undo_all()
    except UndoError as error:
        warn(f"a collected wrapper could not undo its changes to the model: {error}", UserWarning)


_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GraphedModule | GraphedTowers]] = (
    weakref.WeakKeyDictionary()
)
"""The wrapper of each model wrapped and not unwrapped, so that a second wrap is refused."""


def _wrapper_of(model: nn.Module) -> GraphedModule | GraphedTowers | None:
    """The live wrapper of ``model`` that was not unwrapped, or ``None``."""
    held = _WRAPPERS.get(model)
    graphed = held() if held is not None else None
    return None if graphed is None or graphed.unwrapped else graphed


def _auto_plan(
    registry: AdapterRegistry, model: nn.Module, options: dict[str, Any], context: PlanContext
) -> tuple[Adapter, CapturePlan]:
    """The adapter ``adapter="auto"`` chooses for ``model`` and its plan. An adapter of another
    distribution whose ``plan`` raises anything but :class:`AdapterMismatch` is recorded as
    failed and passed over, with a warning, for the next adapter that recognises the model; if
    none is left, the first failure is raised. layergraph's own adapters' errors are raised as
    they are (theirs are deliberate refusals, such as a model wrapped already)."""
    failed: list[str] = []
    first: BaseException | None = None
    while True:
        try:
            name = registry.recognize(model, skip=failed)
        except UnknownAdapterError:
            if first is not None:
                raise first from None
            raise
        adapter_object = registry.create(name, options)
        try:
            return adapter_object, make_plan(adapter_object, model, context)
        except AdapterMismatch:
            raise
        except Exception as error:
            if registry.info(name).first_party:
                raise
            registry.record_failure(name, model, "plan", error)
            failed.append(name)
            first = first or error


def _fingerprint(model: nn.Module, adapter: Adapter, options: dict[str, Any]) -> str:
    """What a measurement of ``model`` depends on, hashed: its class, the adapter, the
    options that change what runs, and every parameter's name, shape and dtype."""
    parameters = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    described = repr(
        (
            type(model).__module__,
            type(model).__qualname__,
            adapter.name,
            sorted((name, repr(value)) for name, value in options.items()),
            parameters,
        )
    )
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def unwrap(graphed: GraphedModule) -> nn.Module:
    """Release ``graphed``'s graphs and return the original model, as it was before wrapping."""
    return graphed.unwrap()


class _Route:
    """Where the calls of a region routed inside the model go: the runner, or a capture."""

    def __init__(self) -> None:
        self.target: Callable[..., Any] | None = None
        self.runner: GraphRunner | None = None
        """The runner whose statistics count the plan's own eager runs."""

    def count_eager(self, reason: str, size: int | None = None) -> None:
        """Count an eager run the plan made on its own, for ``reason`` (a field computed on
        demand), in the wrapper's ``stats``."""
        if self.runner is not None:
            self.runner.count_eager(reason, size)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.target is None:
            raise RuntimeError("this model's wrapper was unwrapped; its routing is gone")
        return self.target(*args, **kwargs)

    @contextlib.contextmanager
    def diverted(self, target: Callable[..., Any]) -> Iterator[None]:
        """Send the calls to ``target`` for the duration of a ``with`` block."""
        previous, self.target = self.target, target
        try:
            yield
        finally:
            self.target = previous


class GraphedModule(nn.Module):
    """A model whose forward replays CUDA graphs where it can and runs eagerly where it cannot.

    Calls take the model's arguments and return what the model returns. Attributes the wrapper
    does not define (``num_classes``, other methods) are looked up on the model; the model's
    methods (``generate``, ``get_image_features``) run inside the same scope as ``forward``,
    so a region the plan routes inside the model reaches the graphs from them too. The model
    is a submodule named ``module``, so ``state_dict`` keys gain a ``module.`` prefix; save
    ``graphed.module`` to avoid it.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        plan: CapturePlan,
        runner: GraphRunner,
        changes: ChangeLedger,
        route: _Route,
        compile_budget: CompileBudget | None = None,
        fingerprint: str = "",
    ) -> None:
        super().__init__()
        self.module = model
        self.adapter = adapter
        self._plan = plan
        self._runner = runner
        self._changes = changes
        self._route = route
        self._compile_budget = compile_budget or CompileBudget()
        self._has_scope = type(plan).forward_scope is not CapturePlan.forward_scope
        """Whether the plan has a scope to enter around each call (the base class's is empty)."""
        self._call: Callable[..., Any] = runner if plan.serves_forward else model.__call__
        self.unwrapped = False
        """Whether :meth:`unwrap` was called: the wrapper then refuses every call."""
        self.fingerprint = fingerprint
        """The model, adapter and options as a warm start's measurements know them: a file's
        measurements are used only by a wrapper of equal fingerprint."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_wrapped()
        if not self._has_scope:
            return self._call(*args, **kwargs)
        with self._plan.forward_scope():
            return self._call(*args, **kwargs)

    def capture(
        self,
        *args: Any,
        batch_sizes: Sequence[int] | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> list[ShapeKey]:
        """Capture graphs now for an example call, one per batch size, largest first.

        ``batch_sizes`` defaults to the wrapper's ``batch_sizes``. The example's rows are
        repeated to fill each size; its other dimensions fix the sequence. For a model that
        packs images into token budgets the sizes are token budgets (default: those given to
        ``wrap``, or learnt so far, or the one that holds the example), each captured from the
        example's images that fit it. Shows a progress bar when rich is installed and
        ``progress`` is true. Returns the keys captured.
        """
        self._check_wrapped()
        if self._plan.serves_forward:
            return self._runner.capture(*args, batch_sizes=batch_sizes, progress=progress, **kwargs)
        driver = self._plan.capture_module
        keys: list[ShapeKey] = []

        def capture_then_serve(*region_args: Any, **region_kwargs: Any) -> Any:
            keys.extend(
                self._runner.capture(
                    *region_args, batch_sizes=batch_sizes, progress=progress, **region_kwargs
                )
            )
            return self._runner(*region_args, **region_kwargs)

        with self._route.diverted(capture_then_serve):
            # A plan may serve its first wrapped call without the graphs (the sequential
            # adapter checks how the model calls its layers then); the second call captures.
            for _ in range(2):
                if driver is None:
                    self.forward(*args, **kwargs)
                else:
                    with self._plan.forward_scope():
                        driver(*args, **kwargs)
                if keys:
                    break
        return keys

    @property
    def plan(self) -> CapturePlan:
        """The adapter's capture plan for this model (what is captured, and how)."""
        return self._plan

    @property
    def changes(self) -> list[str]:
        """What wrapping changed in the model, oldest first (``"path: what"``), all of it
        undone by :meth:`unwrap`; empty for a plan that changes nothing."""
        return self._changes.descriptions

    @property
    def speed_options(self) -> Mapping[str, str]:
        """What each of the adapter's speed options became for this model: ``"on"``, ``"off"``,
        or ``"off: why"`` for one left to ``"auto"`` that does not fit (a model on the CPU, a
        family without the layers it rewrites); empty for adapters without speed options."""
        return self._plan.speed_options

    @property
    def compile_budget(self) -> CompileBudget:
        """Seconds spent compiling (``spent``), the cap (``seconds``, ``None`` for none), and
        whether it is reached (``exhausted``); nothing is spent without compiled layers or
        region."""
        return self._compile_budget

    def finish_compiling(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: as long as it takes) for the background
        compile of ``compile_layers="auto"``, if one runs; whether none runs now. Calls never
        wait for it (keys take compiled code at their next call). For readiness, benchmarks."""
        return self._runner.finish_compiling(timeout)

    def save_warm_start(self, path: str | os.PathLike[str]) -> int:
        """Save what this process compiled (Inductor's cache artifacts and cache files) and
        what this wrapper measured to ``path``, for ``wrap(..., warm_start=path)`` in another
        process on the same GPU and versions.

        Capture the shapes to serve first. Returns the bytes written; see
        :mod:`layergraph.warm_start`.
        """
        measured = Measurements(
            self.fingerprint,
            self._runner.measurements(),
            self._runner.token_totals(),
            self.stats.budgets,
            self._plan.measured_choices(),
        )
        return save_warm_start(path, measured)

    @property
    def stats(self) -> GraphStats:
        """Graphs, captures, replays, padded and eager calls (with reasons), FLOPs, pool bytes,
        capture and compile seconds."""
        return dataclasses.replace(self._runner.stats(), compile_seconds=self._compile_budget.spent)

    @property
    def keys(self) -> list[ShapeKey]:
        """The shape keys of the graphs held now."""
        return self._runner.keys

    @property
    def graphs(self) -> tuple[GraphInfo, ...]:
        """The graphs held now, least recently used first: each one's key, the buffers it
        reads (inputs, attention metadata, workspaces), its output buffers, what was measured
        and whether it was validated (:class:`~layergraph.runner.GraphInfo`). A snapshot, for
        inspection: replay through the wrapper."""
        return self._runner.graphs()

    def release(self) -> None:
        """Drop every graph and the shared pool; later calls capture again.

        Forward hooks added to (or removed from) the model after wrapping make calls run
        eagerly, since a replay would skip them (or replay them); after ``release()`` the
        hooks the model has then are captured with the new graphs.
        """
        self._runner.release()

    @contextlib.contextmanager
    def original(self) -> Iterator[nn.Module]:
        """The model as it was before wrapping, for the duration of a ``with`` block.

        Every change in :attr:`changes` is undone (once a background compile, which runs the
        changed model, is done) and made again afterwards; the graphs are kept. For comparisons
        (benchmarks, checks against eager); calls through the wrapper meanwhile run it too.
        """
        self._check_wrapped()
        self.finish_compiling()
        with self._changes.suspended():
            yield self.module

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedModule:
        raise TypeError(self._not_copied("copied"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(self._not_copied("pickled"))

    def _not_copied(self, done: str) -> str:
        return (
            f"a wrapper of {type(self.module).__name__} is not {done}: its graphs live on one "
            f"device in one process. The model is {done} as an ordinary, unwrapped model: "
            f"use graphed.module, and wrap the result again where it is needed"
        )

    def unwrap(self) -> nn.Module:
        """Release the graphs, undo every change in :attr:`changes`, and return the model.

        Afterwards the model holds the same parameter and buffer objects (with the values they
        hold now), has the same classes, and keeps no attribute or hook of layergraph's; the
        wrapper refuses every call (a ``RuntimeError`` naming ``unwrap``), and the model may be
        wrapped again. A second ``unwrap()`` returns the model again.
        """
        if not self.unwrapped:
            self._runner.release()
            self._changes.undo_all()
            self._route.target = None
            self.unwrapped = True
            _WRAPPERS.pop(self.module, None)
        return self.module

    def _check_wrapped(self) -> None:
        """Raise ``RuntimeError`` if :meth:`unwrap` was called."""
        if self.unwrapped:
            raise RuntimeError(
                f"this wrapper of a {type(self.module).__name__} was unwrapped (unwrap() undid "
                f"its changes and released its graphs); call the model unwrap() returned, or "
                f"wrap it again"
            )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        value = getattr(self._modules["module"], name)
        if inspect.ismethod(value) and value.__self__ is self._modules["module"]:
            self._check_wrapped()
            return self._scoped(value)
        return value

    def _scoped(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` of the model, run inside the plan's forward scope."""

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._plan.forward_scope():
                return method(*args, **kwargs)

        return call
