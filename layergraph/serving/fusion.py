"""Compiled layers chosen per graph key by measurement, never compiled on the call path.

With ``compile_layers="auto"`` (``wrap``'s default where graphs are CUDA graphs) a model's
repeated layers are compiled (:func:`~layergraph.compiling.compile_layers_in_place`, dynamic
shapes) behind a :class:`~layergraph.compiling.CompiledSwitch`, and :class:`LayerFusion`
decides, key by key, whether a graph holds them compiled or as the adapter built them:

1. a call's key is captured as built, at once, and served;
2. compiled code is compiled ahead, by a capture ahead (``graphed.capture(...)``) in the
   caller's thread, which decides for each size before it returns; or, with
   ``{"auto": True, "background": True}``, in a background thread at a key's first capture, on
   buffers of its own, under the caller's grad mode, on the side stream, while no graph is
   captured in the process (:func:`capture_turn`: on a GPU a capture cannot share the device
   with another thread's work; calls of keys without a graph run eagerly meanwhile);
3. at a key's call once compiled code exists, the key is captured again with the switch on,
   under ``torch.compiler.set_stance("fail_on_recompile")``, so that the call never waits for
   a compiler: a key that needs a version not compiled yet keeps its graph as built (until a
   capture ahead compiles it, or, in the background, one more compile: :data:`_TRIES`);
4. both replays are timed and the compiled graph replaces the other only if measured faster
   (:func:`~layergraph.serving.policy.fusion_choice`). ``graphed.stats.fusion`` says what each
   key got and why.

The background is not the default: PyTorch marks a compile session in a process-wide flag
(``torch.compiler.is_compiling()``), and code that reads it in other threads meanwhile takes
its compile-time path (transformers' output capturing then collects no hidden states for a
call made while a background compile runs). What this does not do: choose between the adapter's
hand-written fusions and none.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..adapter import CapturePlan
from ..compiling import (
    CompileBudget,
    CompiledSwitch,
    LayerCompileSetting,
    compile_layers_in_place,
    compiled_region,
    measured_compile,
)
from ..graphs import side_stream
from ..ledger import ChangeLedger
from ..warn import warn
from .cache import GraphEntry
from .policy import Costs, FusionChoice, fusion_choice

if TYPE_CHECKING:
    from ..graphs import GraphBackend
    from ..packing import Call

__all__ = [
    "COMPILING_REASON",
    "CompileFailedWarning",
    "FusedEngine",
    "LayerFusion",
    "capture_turn",
    "uncompiled",
]

_AHEAD = "graphed.capture() compiles ahead"

COMPILING_REASON = "layers are compiling in the background (compile_layers='auto')"
"""The eager reason of a call whose key would be captured while a background compile runs."""

_TRIES = 2
"""Background compiles one key may start: one more than the first is for a version that the
capture's static buffers need and an earlier call's did not; past that the key keeps its
graph as built."""

_LANE = threading.RLock()
"""Held by a background compile for as long as it runs, and by every capture in the process
(:func:`capture_turn`): a CUDA stream capture fails if another thread allocates device memory
or synchronises meanwhile, as a compile does."""


class FusedEngine(Protocol):
    """What :class:`LayerFusion` asks of the engine whose keys it reviews
    (:class:`~layergraph.serving.engine.GraphEngine`)."""

    backend: GraphBackend

    def prepared_region(self, budget: int, call: Call) -> tuple[Callable[[], Any], Any]: ...
    def capture_graph(self, lookup: Any, call: Call) -> GraphEntry: ...
    def replay_ms(self, entry: GraphEntry, call: Call) -> float: ...
    def swap(self, lookup: Any, entry: GraphEntry) -> GraphEntry: ...


class CompileFailedWarning(UserWarning):
    """Compiling a model's layers in the background failed: every key keeps its graph as
    built. Warned once per wrapped model."""


@contextlib.contextmanager
def capture_turn(wait: bool) -> Iterator[bool]:
    """The process's turn to capture, held for the block: ``True`` inside if taken; without
    ``wait``, ``False`` at once while a background compile runs."""
    taken = _LANE.acquire(blocking=wait)
    try:
        yield taken
    finally:
        if taken:
            _LANE.release()


def uncompiled() -> contextlib.AbstractContextManager[Any]:
    """Compiled code run as its original code inside the block, compiling nothing
    (``set_stance("force_eager")`` where PyTorch has stances)."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


class LayerFusion:
    """Which graph each key of one wrapped model keeps, its layers compiled or as built,
    chosen by measurement (the module docstring); the background compiles that make compiled
    code ready without a call waiting for them."""

    def __init__(
        self,
        switch: CompiledSwitch,
        region: Callable[..., Any] | None = None,
        background: bool = False,
    ) -> None:
        self.switch = switch
        self.background = background
        """Whether a key without compiled code for it gets it from a background thread
        (``{"auto": True, "background": True}``); otherwise only a capture ahead compiles."""
        self.region = region
        """For a plan captured whole, its region routed to its compiled version: what
        warm-up and capture run in place of the plan's region; ``None`` for compiled layers."""
        self._job: threading.Thread | None = None
        self._compiled = 0
        """Background or ahead compiles finished."""
        self._failure: str | None = None
        self._tries: Counter[Hashable] = Counter()
        self._uncompiled: set[Hashable] = set()
        """Keys whose recapture found no compiled version for them since the last compile:
        not tried again until one more compiles."""
        self._kept: dict[Hashable, FusionChoice] = {}
        """Choices that kept a key's graph as built, so that a key captured again (after an
        eviction) is not measured again; forgotten with the model."""

    @classmethod
    def of(
        cls,
        plan: CapturePlan,
        setting: LayerCompileSetting | None,
        device_type: str,
        budget: CompileBudget,
        changes: ChangeLedger,
    ) -> LayerFusion | None:
        """The plan's layers compiled behind a switch (each a recorded change), or for a plan
        that names no layers (captured whole: a convnet) its region compiled per shape, and
        the choice between them and the model as built, for a ``compile_layers`` that is
        measured on ``device_type`` (:func:`~layergraph.compiling.measured_compile`); else
        ``None``."""
        options = None if setting is None else measured_compile(setting, device_type)
        if options is None:
            return None
        background = bool(options.pop("background", False))
        switch = CompiledSwitch()
        if plan.layers():
            compile_layers_in_place(plan, "", options, budget, changes, switch)
            return cls(switch, background=background)
        compiled = compiled_region(plan, {"dynamic": False, **options}, budget)
        assert compiled is not None
        return cls(switch, switch.route(plan.region, compiled), background)

    @property
    def compiling(self) -> bool:
        """Whether a background compile of this model's layers runs now."""
        return self._job is not None and self._job.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compile under way, if any; whether none runs now."""
        job = self._job
        if job is not None:
            job.join(timeout)
        return not self.compiling

    def forget(self) -> None:
        """The model changed or its graphs were released: decide every key again."""
        self._kept.clear()
        self._tries.clear()
        self._uncompiled.clear()

    def choice_of(self, entry: GraphEntry) -> FusionChoice:
        """What ``entry``'s key holds and why, for the statistics."""
        if entry.fusion is not None:
            return entry.fusion
        if self._failure is not None:
            return FusionChoice(False, f"compiling failed: {self._failure}")
        if self.compiling:
            return FusionChoice(False, "compiling in the background")
        sizes = {lookup[0] for lookup in self._uncompiled}  # type: ignore[index]
        if not self._compiled or entry.key.batch in sizes:
            return FusionChoice(False, f"not compiled for this size yet ({_AHEAD})")
        return FusionChoice(False, "not measured yet")

    def review(
        self,
        engine: FusedEngine,
        lookup: Hashable,
        entry: GraphEntry,
        call: Call,
        ahead: bool = False,
    ) -> GraphEntry:
        """The entry that serves ``lookup`` now: ``entry`` until its compiled graph was
        captured and measured, then the faster of the two. Starts the background compile a
        key needs; ``ahead`` compiles in this thread instead."""
        if entry.fusion is not None or entry.costs is None:
            return entry
        if ahead:
            self.wait()
        elif self.compiling:
            return entry
        if self._failure is not None or lookup in self._kept:
            choice = self._kept.get(lookup) or self.choice_of(entry)
            return engine.swap(lookup, replace(entry, fusion=choice))
        if not ahead and (not self._compiled or lookup in self._uncompiled):
            if self.background and not self._compiled:
                self._compile_in_background(engine, lookup, call)
            return entry
        with capture_turn(wait=ahead) as turn:
            if not turn:
                return entry
            return self._measured(engine, lookup, entry, call, ahead)

    def _measured(
        self, engine: FusedEngine, lookup: Hashable, entry: GraphEntry, call: Call, ahead: bool
    ) -> GraphEntry:
        """Capture ``lookup`` with compiled layers and keep the faster graph; without
        ``ahead`` the capture may not compile (a key that needs it is compiled in the
        background and keeps ``entry`` for now)."""
        stance = (
            contextlib.nullcontext() if ahead else torch.compiler.set_stance("fail_on_recompile")
        )
        try:
            with stance, self.switch.on():
                candidate = engine.capture_graph(lookup, call)
        except Exception as error:
            traceback.clear_frames(error.__traceback__)
            needs_compile = "fail_on_recompile" in str(error)
            if needs_compile and not self.background:
                self._uncompiled.add(lookup)
                return entry
            if needs_compile and self._tries[lookup] < _TRIES:
                self._compile_in_background(engine, lookup, call)
                return entry
            reason = (
                "need a version per shape"
                if needs_compile
                else f"failed to capture: {type(error).__name__}: {error}"
            )
            return self._keep(engine, lookup, entry, FusionChoice(False, f"compiled {reason}"))
        self._compiled += 1
        self._uncompiled.clear()
        plain_ms, compiled_ms = engine.replay_ms(entry, call), engine.replay_ms(candidate, call)
        choice = fusion_choice(plain_ms, compiled_ms)
        if not choice.compiled:
            return self._keep(engine, lookup, entry, choice)
        assert entry.costs is not None
        costs = Costs(entry.costs.eager_ms, compiled_ms)
        return engine.swap(
            lookup, replace(candidate, costs=costs, fusion=choice, record=entry.record)
        )

    def _keep(
        self, engine: FusedEngine, lookup: Hashable, entry: GraphEntry, choice: FusionChoice
    ) -> GraphEntry:
        self._kept[lookup] = choice
        return engine.swap(lookup, replace(entry, fusion=choice))

    def _compile_in_background(self, engine: FusedEngine, lookup: Hashable, call: Call) -> None:
        """Run the region of ``lookup`` once with compiled layers in a background thread
        holding the capture lane, on buffers of its own loaded with ``call`` now, under this
        thread's grad mode: Dynamo compiles what the key's capture will run. A failure is
        recorded and warned of."""
        self._tries[lookup] += 1
        region, _ = engine.prepared_region(lookup[0], call)  # type: ignore[index]
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        stream, device = None, None
        if engine.backend.device_type == "cuda":
            device = torch.cuda.current_device()
            stream = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream())  # after the buffers' load

        def job() -> None:
            with _LANE:
                try:
                    with contextlib.ExitStack() as modes:
                        modes.enter_context(torch.inference_mode(inference))
                        modes.enter_context(torch.set_grad_enabled(grad))
                        modes.enter_context(self.switch.on())
                        if stream is not None:
                            modes.enter_context(torch.cuda.device(device))
                            modes.enter_context(torch.cuda.stream(stream))
                        region()
                    if stream is not None:
                        stream.synchronize()
                    self._compiled += 1
                    self._uncompiled.clear()
                except Exception as error:
                    traceback.clear_frames(error.__traceback__)
                    self._failure = f"{type(error).__name__}: {error}"
                    warn(
                        f"compiling the model's layers failed ({self._failure}); its graphs "
                        f"keep the layers as built (compile_layers=False turns compiling off)",
                        CompileFailedWarning,
                    )

        self._job = threading.Thread(target=job, name="layergraph-compile", daemon=True)
        self._job.start()
