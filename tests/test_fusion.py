"""Compiled layers chosen per key by measurement (``compile_layers="auto"``): each key served
at once by its graph as built, the layers compiled in a background thread, the key captured
again with them and the faster graph kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_compiled_layers import ATOL, Counting, blocks, eager
from torch import nn

import layergraph
from layergraph.compiling import measured_compile
from layergraph.serving.fusion import COMPILING_REASON, CompileFailedWarning
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

EAGER, AS_BUILT, COMPILED = 10.0, 1.0, 0.5
"""Milliseconds the simulated backend gives: an eager call, a replay of a graph as built, of
a graph with compiled layers."""


class SlowCompiler(Counting):
    """A compiler backend that takes ``seconds`` to compile each graph."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def __call__(self, gm: torch.fx.GraphModule, example: list[Any]) -> Any:
        time.sleep(self.seconds)
        return super().__call__(gm, example)


def measured(
    compiler: Callable[..., Any], compiled_ms: float = COMPILED, model: nn.Module | None = None
) -> layergraph.GraphedModule:
    """``model`` (three blocks) wrapped on the simulated backend with compiled layers chosen by
    measurement: a graph as built replays in :data:`AS_BUILT` ms, one with compiled layers in
    ``compiled_ms``."""
    return layergraph.wrap(
        blocks() if model is None else model,
        adapter=layergraph.SequentialAdapter(),
        backend=SimulatedGraphs(
            lambda rows: EAGER, lambda rows: AS_BUILT, compiled_replay_ms=lambda rows: compiled_ms
        ),
        batch_sizes=None,
        compile_layers={"auto": True, "background": True, "backend": compiler},
    )


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def served(graphed: layergraph.GraphedModule, batch: int) -> torch.Tensor:
    """A call of ``batch`` fresh random rows, checked against the model as it was."""
    x = torch.randn(batch, 7, 16)
    got = graphed(x)
    torch.testing.assert_close(got, eager(graphed, x), atol=ATOL, rtol=0)
    return got


@pytest.mark.quick
def test_the_first_calls_never_wait_for_a_slow_compiler() -> None:
    import torch.utils.flop_counter  # the first capture's FLOP count imports it (and Triton)

    compiler = SlowCompiler(seconds=6.0)
    graphed = measured(compiler)
    with torch.inference_mode():
        started = time.perf_counter()
        calls = [torch.randn(batch, 7, 16) for batch in (4, 4, 2)]
        # Its graph as built; again while the layers compile; a new size runs eagerly (no
        # capture while the compiler holds the device).
        answers = [graphed(x) for x in calls]
        assert time.perf_counter() - started < 4.0  # one compile alone takes 6 s
        stats = graphed.stats
        assert stats.replays == 2 and stats.eager_calls[COMPILING_REASON] == 1
        assert not stats.fusion[4].compiled
        assert "compiling in the background" in str(stats.fusion[4])
        assert graphed.finish_compiling(timeout=120)
        for x, answer in zip(calls, answers):
            torch.testing.assert_close(answer, eager(graphed, x), atol=ATOL, rtol=0)
        assert compiler.compiled >= 1
        served(graphed, 4)  # captured again with compiled layers, measured, kept
        choice = graphed.stats.fusion[4]
        assert choice.compiled and (choice.plain_ms, choice.compiled_ms) == (AS_BUILT, COMPILED)
        compiled = compiler.compiled
        compiler.ran.clear()
        for batch in (4, 2, 3, 4):
            served(graphed, batch)
    stats = graphed.stats
    assert all(stats.fusion[batch].compiled for batch in (2, 3, 4)), stats.fusion
    assert compiler.compiled == compiled  # one version served the new sizes
    assert compiler.ran.count(4) >= 3  # the replays ran the compiled code: 3 layers
    assert "compiled layers: 0.500 ms compiled against 1.000 ms as built" in str(stats)


@pytest.mark.quick
def test_a_compiled_graph_not_measured_faster_is_not_kept() -> None:
    compiler = Counting()
    graphed = measured(compiler, compiled_ms=0.99 * AS_BUILT)
    with torch.inference_mode():
        served(graphed, 3)
        assert graphed.finish_compiling(timeout=120)
        served(graphed, 3)
        captures = graphed.stats.captures
        compiler.ran.clear()
        served(graphed, 3)
    choice = graphed.stats.fusion[3]
    assert not choice.compiled and "not faster" in choice.reason
    assert graphed.stats.captures == captures  # decided once
    assert compiler.ran == []  # the graph kept runs the layers as built
    (info,) = graphed.graphs
    assert info.fusion == choice


@pytest.mark.quick
def test_by_default_only_a_capture_ahead_compiles_and_later_keys_take_its_code() -> None:
    """Without the background, nothing compiles on the call path or beside it: keys are
    served as built until a capture ahead compiles; then a key captured later, and a key held
    since, take the compiled code at their next call without compiling."""
    compiler = Counting()
    graphed = layergraph.wrap(
        blocks(),
        adapter=layergraph.SequentialAdapter(),
        backend=timed(),
        batch_sizes=None,
        compile_layers={"auto": True, "backend": compiler},
    )
    with torch.inference_mode():
        served(graphed, 4)
        assert "not compiled for this size yet" in graphed.stats.fusion[4].reason
        assert compiler.compiled == 0 and graphed.finish_compiling(timeout=0)
        graphed.capture(torch.randn(8, 7, 16), batch_sizes=[8, 4], progress=False)
        assert graphed.stats.fusion[4].compiled  # held, and decided by the capture ahead
        compiled = compiler.compiled
        for batch in (3, 4, 8):
            served(graphed, batch)
    fusion = graphed.stats.fusion
    assert [fusion[batch].compiled for batch in (3, 4, 8)] == [True] * 3, fusion
    assert compiler.compiled == compiled > 0


@pytest.mark.quick
def test_a_capture_ahead_compiles_and_decides_before_it_returns() -> None:
    compiler = Counting()
    graphed = measured(compiler)
    with torch.inference_mode():
        graphed.capture(torch.randn(8, 7, 16), batch_sizes=[8, 2], progress=False)
        stats = graphed.stats
        assert {batch: stats.fusion[batch].compiled for batch in (8, 2)} == {8: True, 2: True}
        captures = stats.captures
        for batch in (8, 2):
            served(graphed, batch)
    assert graphed.stats.captures == captures and graphed.stats.eager_total == 0


@pytest.mark.quick
def test_a_failed_compile_is_warned_of_and_keeps_the_graphs_as_built() -> None:
    def failing(gm: torch.fx.GraphModule, example: list[Any]) -> Any:
        raise RuntimeError("no kernels today")

    graphed = measured(failing)
    with torch.inference_mode(), pytest.warns(CompileFailedWarning, match="no kernels today"):
        served(graphed, 2)
        assert graphed.finish_compiling(timeout=120)
    with torch.inference_mode():
        for batch in (2, 5):
            served(graphed, batch)
    stats = graphed.stats
    assert stats.graphs == 2 and stats.eager_total == 0
    assert all("compiling failed" in choice.reason for choice in stats.fusion.values())
    assert not any(choice.compiled for choice in stats.fusion.values())


@pytest.mark.quick
def test_auto_compiles_only_where_graphs_are_cuda_graphs() -> None:
    assert measured_compile("auto", "cuda") == {}
    assert measured_compile("auto", "cpu") is None
    assert measured_compile({"auto": True, "mode": "max-autotune"}, "cpu") == {
        "mode": "max-autotune"
    }
    assert measured_compile(True, "cuda") is None and measured_compile(False, "cuda") is None
    model = blocks()
    graphed = layergraph.wrap(
        model, adapter=layergraph.SequentialAdapter(), backend=SimulatedGraphs()
    )
    with torch.inference_mode():
        served(graphed, 2)
    assert graphed.stats.fusion == {} and graphed.finish_compiling(timeout=0)
    assert all(layer._compiled_call_impl is None for layer in model)


@pytest.mark.quick
def test_eager_calls_and_unwrap_run_the_layers_as_built() -> None:
    compiler = Counting()
    model = blocks()
    graphed = measured(compiler, model=model)
    with torch.inference_mode():
        served(graphed, 2)
        assert graphed.finish_compiling(timeout=120)
        compiler.ran.clear()
        with torch.enable_grad(), pytest.warns(layergraph.EagerModeWarning):
            graphed(torch.randn(2, 7, 16, requires_grad=True))  # runs eagerly
    assert compiler.ran == []
    assert graphed.unwrap() is model
    assert all(layer._compiled_call_impl is None for layer in model)


def tower_names() -> list[str]:
    from tiny_models import TOWERS

    return list(TOWERS)


@pytest.mark.slow
@pytest.mark.parametrize("name", tower_names())
def test_every_tower_takes_compiled_layers_by_measurement(name: str) -> None:
    """Each fixed-resolution family's layers, compiled in the background and chosen by
    measurement on the faithful replay: batches 2, 3, 5 and 8 each end with the compiled graph,
    equal to eager, from at most two compiled versions (one per kind of layer)."""
    from tiny_models import TOWERS

    tiny = TOWERS[name]
    if not tiny.available():
        pytest.skip(f"{name} is not in this transformers")
    compiler = Counting()
    graphed = layergraph.wrap(
        tiny.build(),
        backend=SimulatedGraphs(
            lambda rows: EAGER, lambda rows: AS_BUILT, compiled_replay_ms=lambda rows: COMPILED
        ),
        batch_sizes=None,
        compile_layers={"auto": True, "background": True, "backend": compiler},
    )
    with torch.inference_mode():
        tiny.answer(graphed, 2, seed=0)
        assert graphed.finish_compiling(timeout=300)
        for batch in (2, 3, 5, 8):
            got = tiny.answer(graphed, batch, seed=batch)
            with graphed.original() as model:
                want = tiny.answer(model, batch, seed=batch)
            assert relative_error(got, want) <= 1e-6, batch
    stats = graphed.stats
    assert [stats.fusion[batch].compiled for batch in (2, 3, 5, 8)] == [True] * 4, stats.fusion
    assert stats.eager_total == 0 and compiler.compiled <= 2
    graphed.unwrap()


def test_a_model_captured_whole_takes_its_region_compiled_per_shape_by_measurement() -> None:
    """A convnet (no repeated layers named: captured whole) gets its whole region compiled,
    per shape, in the background: each batch size's first capture is as built, a new size
    needs its own compile (the capture never waits for it), and each ends compiled where that
    measures faster, equal to eager."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    compiler = Counting()
    graphed = layergraph.wrap(
        model,
        backend=SimulatedGraphs(
            lambda rows: EAGER, lambda rows: AS_BUILT, compiled_replay_ms=lambda rows: COMPILED
        ),
        batch_sizes=None,
        compile_layers={"auto": True, "background": True, "backend": compiler},
    )

    def check(batch: int) -> None:
        x = torch.randn(batch, 3, 64, 64)
        torch.testing.assert_close(graphed(x), model(x), rtol=1e-4, atol=1e-5)

    with torch.inference_mode():
        for batch in (2, 3):
            check(batch)  # its graph as built; its region compiles in the background
            assert not graphed.stats.fusion[batch].compiled
            assert graphed.finish_compiling(timeout=300)
            check(batch)  # captured again with the compiled region, measured, kept
            assert graphed.stats.fusion[batch].compiled
        check(2)
    assert compiler.compiled == 2 and graphed.stats.eager_total == 0
    assert graphed.unwrap() is model


def timed() -> SimulatedGraphs:
    """The simulated backend, its graphs with compiled layers measured the faster."""
    return SimulatedGraphs(
        lambda rows: EAGER, lambda rows: AS_BUILT, compiled_replay_ms=lambda rows: COMPILED
    )


@pytest.mark.slow
def test_an_audio_encoder_takes_compiled_layers_for_four_clip_counts() -> None:
    from test_audio_encoders import features, whisper_config

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    encoder = transformers.WhisperModel(whisper_config(encoder_layers=3)).encoder.eval()
    compiler = Counting()
    graphed = layergraph.wrap(
        encoder,
        backend=timed(),
        batch_sizes=None,
        compile_layers={"auto": True, "background": True, "backend": compiler},
    )
    with torch.inference_mode():
        graphed(features(2, seed=0))
        assert graphed.finish_compiling(timeout=300)
        for clips in (2, 3, 5, 8):
            x = features(clips, seed=clips)
            with graphed.original() as original:
                want = original(x).last_hidden_state
            assert relative_error(graphed(x).last_hidden_state, want) <= 1e-6, clips
    fusion = graphed.stats.fusion
    assert [fusion[clips].compiled for clips in (2, 3, 5, 8)] == [True] * 4, fusion
    assert compiler.compiled == 1


@pytest.mark.slow
def test_each_tower_of_a_model_of_several_takes_compiled_layers_by_measurement() -> None:
    """A tower of a model of several, captured ahead: its sizes compiled in the caller's thread
    and decided, the model's own calls then served by the faster graphs, equal to eager. (Not
    in the background: the model's calls run transformers' output capturing, which misreads
    PyTorch's process-wide compile flag while another thread compiles.)"""
    from test_multi_tower import assert_close, images, video_llava

    model = video_llava()
    compiler = Counting()
    pictures = {batch: images(batch) for batch in (1, 2, 3)}
    with torch.inference_mode():
        want = {batch: model.get_image_features(x) for batch, x in pictures.items()}
        graphed = layergraph.wrap(
            model, backend=timed(), compile_layers={"auto": True, "backend": compiler}
        )
        tower = graphed.towers["model.image_tower"]
        example = {"return_dict": True, "output_hidden_states": -2}  # as the model calls it
        tower.capture(pictures[3], **example, batch_sizes=[3, 2, 1], progress=False)
        for batch, x in pictures.items():
            assert_close(model.get_image_features(x), want[batch])
    fusion = graphed.stats["model.image_tower"].fusion
    assert all(choice.compiled for choice in fusion.values()) and len(fusion) == 3, fusion
    assert graphed.unwrap() is model


@pytest.mark.slow
def test_inductor_compiled_layers_chosen_by_measurement_replay_equal_to_eager() -> None:
    """Inductor's CPU kernels as the measured choice of each key (batched lane): compiled
    once in the background for four batch sizes, each replay equal to eager."""
    from torch._dynamo.utils import counters

    counters.clear()
    graphed = measured("inductor")
    with torch.inference_mode():
        served(graphed, 2)
        assert graphed.finish_compiling(timeout=600)
        for batch in (2, 3, 5, 8):
            served(graphed, batch)
    fusion = graphed.stats.fusion
    assert [fusion[batch].compiled for batch in (2, 3, 5, 8)] == [True] * 4, fusion
    # One for the graph buffers' tensors (the first layer's input), one for the inference
    # tensors each layer hands the next: each serves every size.
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.slow
def test_inductor_compiled_layers_of_a_packed_tower_chosen_by_measurement() -> None:
    """The packed lane with Inductor: SigLIP2 NaFlex's layers compiled once in the background
    for four token budgets, each replay equal to eager."""
    pytest.importorskip("transformers")
    from test_siglip2_adapter import check, tower

    model = tower()
    graphed = layergraph.wrap(
        model,
        backend=timed(),
        batch_sizes=[32, 64, 96, 128],
        compile_layers={"auto": True, "background": True},
    )
    for grids in ([(4, 4)], [(6, 6), (3, 4)], [(8, 8), (4, 4)], [(8, 8), (6, 8), (2, 2)]):
        check(graphed, model, grids, patches=64)
        assert graphed.finish_compiling(timeout=600)
        check(graphed, model, grids, patches=64)
    fusion = graphed.stats.fusion
    assert [choice.compiled for choice in fusion.values()] == [True] * 4, fusion
