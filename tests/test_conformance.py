"""Conformance: every family the coverage page serves answers as the unwrapped model does, on
the faithful CPU replay, for calls and reads drawn at random.

For each class of the coverage table (:mod:`coverage_table`), hypothesis draws a short stream
of calls: batch sizes (image counts, grids and frame counts for packed towers), the per-call
options the entry point takes (``output_hidden_states``, ``return_dict=False``,
``interpolate_pos_encoding`` at another image size, ``vision_feature_layer``), whether the
caller refills its input tensors between the call and the read, and the order and the way each
field is read (attribute, key, ``to_tuple()``, ``items()``; hidden states by index, slice or
iteration). Each read value is compared with the unwrapped twin's answer on the same inputs
(built from the same seed, never wrapped): float32, 1e-4 relative error, the padding rows a
packed tower zeroes left out. Every wrap is undone after its stream, and the model must then
answer as before.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import test_glm4v_adapter  # noqa: E402, F401  (imported here, not inside a drawn example)
import test_pixtral_adapter as pixtral  # noqa: E402
import test_qwen2_vl_adapter as qwen  # noqa: E402
import test_qwen3_5_adapter  # noqa: E402, F401
import test_qwen3_vl_moe_adapter  # noqa: E402, F401
import test_siglip2_adapter as siglip2  # noqa: E402
from coverage_table import PACKED_SERVED, SERVED, served_stats  # noqa: E402
from test_coverage import packed_tiny  # noqa: E402
from tiny_models import IMAGE, PATCH  # noqa: E402

import layergraph  # noqa: E402
from layergraph.testing import SimulatedGraphs  # noqa: E402
from layergraph.validation import relative_error  # noqa: E402

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
LARGER = IMAGE + 2 * PATCH
"""Another image size, for ``interpolate_pos_encoding=True``."""

ACCESS = ("attribute", "key", "to_tuple", "items")
"""Ways a caller reads a field of a model output."""

EXAMPLES = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as drawn
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- calls -----------------------------------------------------------------------------------


FEATURE_METHODS = ("get_image_features", "get_video_features")
"""The features methods of VLMs a tiny model's call may enter by."""


class Recorded:
    """The entry point a tiny model's call used (``forward``, or a features method of the
    model or of a submodule, :data:`FEATURE_METHODS`) and the inputs it was given, learnt by
    running the call once on the unwrapped twin."""

    def __init__(self, model: torch.nn.Module, call: Callable[[], Any]) -> None:
        self.owner = ""
        """The path of the module whose method was called (``""``: the model)."""
        self.method = "forward"
        self.inputs: dict[str, Any] = {}
        patched = []

        def recording(path: str, method: str, features: Callable[..., Any]) -> Callable[..., Any]:
            def record(*args: Any, **kwargs: Any) -> Any:
                if not self.inputs:
                    bound = inspect.signature(features).bind(*args, **kwargs).arguments
                    named = {k: v for k, v in bound.items() if k != "kwargs"}
                    named.update(bound.get("kwargs", {}))
                    self.owner, self.method, self.inputs = path, method, named
                return features(*args, **kwargs)

            return record

        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.inputs:
                assert not args, "tiny models are called with keyword arguments"
                self.inputs = dict(kwargs)

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        for path, module in model.named_modules():
            for method in FEATURE_METHODS:
                features = getattr(module, method, None)
                if features is not None:
                    setattr(module, method, recording(path, method, features))
                    patched.append((module, method))
        try:
            call()
        finally:
            handle.remove()
            for module, method in patched:
                delattr(module, method)
        assert self.inputs, "the call reached neither forward nor a features method"

    def entry(self, model: torch.nn.Module) -> Callable[..., Any]:
        """The recorded entry point of ``model`` (the wrapped one or its twin)."""
        return getattr(model.get_submodule(self.owner), self.method)

    def options(self, model: torch.nn.Module) -> list[str]:
        """The per-call options the entry point takes by name."""
        parameters = inspect.signature(self.entry(model)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        names = ["output_hidden_states", "return_dict"] if self.method == "forward" else []
        found = [name for name in names if name in parameters or takes_any]
        for name in ("interpolate_pos_encoding", "vision_feature_layer"):
            if name in parameters:
                found.append(name)
        return found


@st.composite
def call_options(draw: st.DrawFn, names: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if "output_hidden_states" in names and draw(st.booleans()):
        options["output_hidden_states"] = True
    if "return_dict" in names and draw(st.booleans()):
        options["return_dict"] = False
    if "interpolate_pos_encoding" in names and draw(st.booleans()):
        options["interpolate_pos_encoding"] = True
    if "vision_feature_layer" in names and draw(st.booleans()):
        options["vision_feature_layer"] = draw(st.sampled_from([-1, -2, 1]))
    return options


def resized(inputs: dict[str, Any], side: int) -> dict[str, Any]:
    """``inputs`` with square pixels of another ``side`` (same batch, fresh values)."""
    pixels = inputs["pixel_values"]
    return {**inputs, "pixel_values": torch.randn(*pixels.shape[:-2], side, side)}


def fresh(inputs: dict[str, Any], batch: int) -> dict[str, Any]:
    """Inputs like ``inputs`` for ``batch`` images: float tensors drawn anew, and every tensor
    whose first dimension is the batch repeated or cut to ``batch``."""
    first = inputs["pixel_values"].shape[0]
    made: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == first:
            value = value[torch.arange(batch) % first]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = torch.randn_like(value)
        made[name] = value
    return made


def refill(inputs: dict[str, Any]) -> None:
    """What a caller does with its input buffers for the next batch: new values, in place."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.copy_(torch.randn_like(value))


def owned(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


# ---- reads -----------------------------------------------------------------------------------


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The tensors of an output, by path, in its own order (the reference read)."""
    if isinstance(value, torch.Tensor) or value is None:
        yield prefix, value
    elif hasattr(value, "keys") and hasattr(value, "to_tuple"):
        for key in list(value.keys()):  # keys(): the fields set, not the dataclass order
            yield from flat(getattr(value, key), f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from flat(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


class ReadPlan:
    """The order and the way each field is read: drawn while reading the reference output,
    then followed while reading the wrapped model's, so that both are read alike (transformers'
    ``to_tuple()`` turns a nested output into a tuple, whichever model gave it)."""

    def __init__(self, data: st.DataObject) -> None:
        self._data = data
        self._choices: list[Any] = []
        self._following: Iterator[Any] | None = None

    def follow(self) -> None:
        """From now on, make the choices drawn so far again, in the same order."""
        self._following = iter(self._choices)

    def choose(self, strategy: st.SearchStrategy[Any], label: str) -> Any:
        if self._following is not None:
            return next(self._following)
        choice = self._data.draw(strategy, label=label)
        self._choices.append(choice)
        return choice


def read(plan: ReadPlan, value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The tensors of an output, by path, read in the order and the way ``plan`` says."""
    if isinstance(value, torch.Tensor) or value is None:
        yield prefix, value
    elif hasattr(value, "keys") and hasattr(value, "to_tuple"):
        keys = list(value.keys())
        order = plan.choose(st.permutations(keys), f"{prefix} order")
        assert sorted(order) == sorted(keys), f"{prefix} has the keys {keys}, not {order}"
        for key in order:
            how = plan.choose(st.sampled_from(ACCESS), f"{prefix}.{key} read by")
            if how == "attribute":
                field = getattr(value, key)
            elif how == "key":
                field = value[key]
            elif how == "to_tuple":
                field = value.to_tuple()[keys.index(key)]
            else:
                field = dict(value.items())[key]
            yield from read(plan, field, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        how = plan.choose(st.sampled_from(("index", "iterate", "slice")), f"{prefix} by")
        if how == "iterate":
            items = list(enumerate(value))
        elif how == "slice":
            items = list(enumerate(value[:]))
        else:
            order = plan.choose(st.permutations(range(len(value))), f"{prefix} order")
            assert sorted(order) == list(range(len(value))), f"{prefix} has another length"
            items = [(index, value[index]) for index in order]
        for index, item in items:
            yield from read(plan, item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def read_alike(data: st.DataObject, got: Any, want: Any) -> tuple[dict[str, Any], ...]:
    """``want`` (the reference) read in a drawn order and way, then ``got`` read alike."""
    plan = ReadPlan(data)
    wanted = dict(read(plan, want))
    plan.follow()
    return served_quietly(lambda: dict(read(plan, got))), wanted


def assert_same(
    got: dict[str, Any],
    want: dict[str, Any],
    real: torch.Tensor | None,
    tolerance: float = TOLERANCE,
) -> None:
    """Equal paths, shapes and values; ``real``: a packed tower's mask of real patches
    ([images, patches]), where its padding rows are not compared."""
    assert sorted(got) == sorted(want)
    for path, expected in want.items():
        have = got[path]
        if not isinstance(expected, torch.Tensor):  # None, or a cache the text model made
            assert type(have) is type(expected), path
            continue
        assert isinstance(have, torch.Tensor) and have.shape == expected.shape, path
        if real is not None and expected.shape[:2] == real.shape:
            have, expected = have[real], expected[real]
        assert relative_error(have.float(), expected.float()) <= tolerance, path


def served_quietly(function: Callable[[], Any]) -> Any:
    """``function()``; an eager-mode warning is allowed (an option the graphs do not serve),
    any other layergraph warning (a failed capture) fails the test."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = function()
    for warning in caught:
        category = warning.category
        if category.__module__.startswith("layergraph"):
            assert category is layergraph.EagerModeWarning, str(warning.message)
    return result


# ---- fixed-shape families --------------------------------------------------------------------


def on(device: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def check_served_class(
    name: str,
    data: st.DataObject,
    device: str = "cpu",
    backend: Any = None,
    tolerance: float = TOLERANCE,
) -> None:
    """Draw a stream of calls of the served class ``name`` and check each against its twin;
    on ``device``, with graphs from ``backend`` (default: the device's own)."""
    tiny = SERVED[name]
    model, twin = tiny.build(), tiny.build()
    with torch.inference_mode():
        recorded = Recorded(twin, lambda: tiny.answer(twin, 2, 0))
        model, twin = model.to(device), twin.to(device)
        recorded.inputs = on(device, recorded.inputs)
        options = recorded.options(twin)
        before = owned(recorded.inputs)
        baseline = recorded.entry(twin)(**before)
        graphed = layergraph.wrap(model, backend=backend, compile_layers=False)
        calls = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3), label="batches")
        for batch in calls:
            chosen = data.draw(call_options(options), label="options")
            inputs = fresh(recorded.inputs, batch)
            if chosen.get("interpolate_pos_encoding"):
                inputs = resized(inputs, LARGER)
            entry = recorded.entry(model)
            try:
                want = recorded.entry(twin)(**owned(inputs), **chosen)
            except (RuntimeError, ValueError, TypeError):  # the model itself refuses the call
                with pytest.raises((RuntimeError, ValueError, TypeError)):
                    entry(**inputs, **chosen)
                continue
            out = served_quietly(lambda: entry(**inputs, **chosen))  # noqa: B023
            if data.draw(st.booleans(), label="refilled before the read"):
                refill(inputs)
            assert_same(*read_alike(data, out, want), None, tolerance)
        assert served_stats(graphed, SERVED[name].adapter).failed_captures == 0
        graphed.unwrap()
        after = dict(flat(recorded.entry(model)(**before)))
    assert_same(after, dict(flat(baseline)), None, tolerance)


@pytest.mark.parametrize("name", sorted(n for n in SERVED if SERVED[n].available()))
@EXAMPLES
@given(data=st.data())
def test_a_served_class_answers_as_eager_however_called_and_read(
    name: str, data: st.DataObject
) -> None:
    check_served_class(name, data, backend=SimulatedGraphs())


# ---- packed families -------------------------------------------------------------------------


def packed_inputs(name: str, grids: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """``get_image_features`` inputs of ``name`` for images of ``grids``: (frames, height,
    width) in units of the family's merged patch (frames past 1 only for Qwen-style towers)."""
    adapter = PACKED_SERVED[name]
    if adapter == "qwen2_vl":
        pixels, grid = qwen.call([(t, 2 * h, 2 * w) for t, h, w in grids])
        return {"pixel_values": pixels, "image_grid_thw": grid}
    if adapter == "pixtral":
        return pixtral.call([(4 * h, 4 * w) for _, h, w in grids])
    return siglip2.call([(2 * h, 2 * w) for _, h, w in grids])


def check_packed_class(
    name: str,
    data: st.DataObject,
    device: str = "cpu",
    backend: Any = None,
    tolerance: float = TOLERANCE,
) -> None:
    """Draw a stream of calls of the packed class ``name`` (images of drawn grids) and check
    each against its twin; on ``device``, with graphs from ``backend``."""
    model, _ = packed_tiny(name)
    twin, _ = packed_tiny(name)
    model, twin = model.to(device), twin.to(device)
    # Several frames per grid entry only where the model takes them: GLM's towers read
    # grid_thw's rows by frame and index out of bounds (a device-side assert on a GPU).
    frames = st.integers(1, 2) if name.startswith("Qwen") else st.just(1)
    image = st.tuples(frames, st.integers(1, 3), st.integers(1, 3))
    with torch.inference_mode():
        graphed = layergraph.wrap(
            model, observe_calls=0, backend=backend, budget_step=32, compile_layers=False
        )
        for _ in range(data.draw(st.integers(1, 3), label="calls")):
            grids = data.draw(st.lists(image, min_size=1, max_size=3), label="images")
            inputs = on(device, packed_inputs(name, grids))
            reference = owned(inputs)
            try:
                want = twin.get_image_features(**owned(inputs))
            except (RuntimeError, ValueError, IndexError):  # the model itself refuses the call
                with pytest.raises((RuntimeError, ValueError, IndexError)):
                    model.get_image_features(**inputs)
                continue
            out = served_quietly(lambda: model.get_image_features(**inputs))  # noqa: B023
            if data.draw(st.booleans(), label="refilled before the read"):
                refill(inputs)
            real = reference.get("pixel_attention_mask")
            mask = None if real is None else real.bool()
            assert_same(*read_alike(data, out, want), mask, tolerance)
        assert served_stats(graphed, PACKED_SERVED[name]).failed_captures == 0
        graphed.unwrap()


@pytest.mark.parametrize("name", sorted(PACKED_SERVED))
@EXAMPLES
@given(data=st.data())
def test_a_packed_class_answers_as_eager_however_called_and_read(
    name: str, data: st.DataObject
) -> None:
    check_packed_class(name, data, backend=SimulatedGraphs())
