"""Compiled layers (``compile_layers``): one compiled version for every batch size and token
budget, and a faithful CPU replay of the compiled code a graph holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

ATOL = 1e-5


class Block(nn.Module):
    """A pre-norm residual MLP block, the shape of a transformer layer's second half."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def blocks(depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(depth))).eval()


def eager(graphed: layergraph.GraphedModule, x: torch.Tensor) -> torch.Tensor:
    """The model as it was before wrapping (its layers not compiled) on ``x``."""
    with graphed.original() as model:
        return model(x)


class Counting:
    """A compiler backend that counts the graphs it compiles and the rows of the activation
    (the first tensor of 3 dimensions or more; 0 where none has) of each run."""

    def __init__(self) -> None:
        self.compiled = 0
        self.ran: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example: list[Any]) -> Any:
        self.compiled += 1

        def run(*args: Any) -> Any:
            rows = (a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() >= 3)
            self.ran.append(next(rows, 0))
            return gm.forward(*args)

        return run


def wrapped(compile_layers: Any, batch_sizes: Any) -> layergraph.GraphedModule:
    """Three blocks wrapped on the simulated backend with ``compile_layers``."""
    return layergraph.wrap(
        blocks(),
        adapter=layergraph.SequentialAdapter(),
        backend=SimulatedGraphs(),
        batch_sizes=batch_sizes,
        compile_layers=compile_layers,
    )


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.quick
def test_compiled_layers_compile_once_for_every_batch_size(fresh_dynamo: None) -> None:
    counting = Counting()
    graphed = wrapped({"backend": counting}, batch_sizes=None)
    with torch.inference_mode():
        for batch in (2, 3, 5, 8, 3):
            x = torch.randn(batch, 7, 16)
            torch.testing.assert_close(graphed(x), eager(graphed, x), atol=ATOL, rtol=0)
            if batch == 2:
                # Two versions: one for the graph's buffers, one for the inference tensors of
                # the eager call each capture is measured against; each serves every size.
                assert counting.compiled == 2
    assert graphed.stats.graphs == 4 and graphed.stats.replays == 5
    assert counting.compiled == 2  # every layer, every size
    assert {2, 3, 5, 8} <= set(counting.ran)
    stats = graphed.stats
    assert stats.compile_seconds == graphed.compile_budget.spent > 0
    assert f"compile={stats.compile_seconds:.1f} s" in str(stats)


@pytest.mark.quick
def test_a_compiled_layers_replay_runs_the_compiled_code_on_refilled_inputs(
    fresh_dynamo: None,
) -> None:
    """The simulated replay runs what the capture ran, compiled code included, on the inputs
    each call copies into the graph's buffers: never the values of the capture's call."""
    counting = Counting()
    graphed = wrapped({"backend": counting}, batch_sizes=[4])
    with torch.inference_mode():
        graphed.capture(torch.randn(4, 5, 16), progress=False)
        counting.ran.clear()
        for _ in range(3):
            x = torch.randn(4, 5, 16)
            torch.testing.assert_close(graphed(x), eager(graphed, x), atol=ATOL, rtol=0)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    assert counting.ran == [4] * 9  # three layers' compiled code in each of three replays


@pytest.mark.slow
def test_inductor_compiled_layers_replay_equal_to_eager(fresh_dynamo: None) -> None:
    """Inductor's own CPU kernels, which run outside ATen's dispatcher, in the simulated
    replay: one compiled version for four batch sizes, each replay equal to eager on its own
    call's inputs."""
    from torch._dynamo.utils import counters

    counters.clear()
    graphed = wrapped(True, batch_sizes=None)
    with torch.inference_mode():
        for batch in (2, 3, 5, 8, 2, 8):
            x = torch.randn(batch, 7, 16)
            torch.testing.assert_close(graphed(x), eager(graphed, x), atol=1e-5, rtol=1e-5)
    assert graphed.stats.replays == 6 and graphed.stats.graphs == 4
    assert counters["stats"]["unique_graphs"] == 2  # the buffers' and inference tensors'


@pytest.mark.slow
def test_a_packed_towers_compiled_layers_replay_equal_to_eager(fresh_dynamo: None) -> None:
    """A packed tower's compiled layers (Qwen2.5-VL's: routed attention, windows, per-budget
    state bound around the capture) on the faithful replay: each budget's replay equals eager
    on its own call. The replay runs the compiled graphs alone, as a GPU's does, not the
    Python around them (the attention's state lookups and the side effects they guard on)."""
    pytest.importorskip("transformers")
    from test_qwen2_vl_adapter import check, tower

    model = tower()
    graphed = layergraph.wrap(
        model,
        backend=SimulatedGraphs(),
        batch_sizes=[64, 128, 192, 256],
        compile_layers={"backend": "aot_eager"},
    )
    for grids in ([(1, 8, 8)], [(1, 8, 12)], [(1, 12, 16)], [(1, 16, 16)], [(1, 8, 8), (1, 4, 8)]):
        check(graphed, model, grids)
    assert graphed.stats.replays == 5 and graphed.stats.graphs == 4


def tower_names() -> list[str]:
    from tiny_models import TOWERS

    return list(TOWERS)


@pytest.mark.slow
@pytest.mark.parametrize("name", tower_names())
def test_every_towers_compiled_layers_serve_four_batch_sizes(name: str, fresh_dynamo: None) -> None:
    """Each fixed-resolution family's compiled layers on the faithful replay: batches 2, 3, 5
    and 8 equal to eager, from one compiled version per kind of layer (Mllama's local and
    global encoders, SAM's windowed and global layers, BEiT's first layer without drop path:
    two), never one per size."""
    from tiny_models import TOWERS

    tiny = TOWERS[name]
    if not tiny.available():
        pytest.skip(f"{name} is not in this transformers")
    counting = Counting()
    graphed = layergraph.wrap(
        tiny.build(),
        backend=SimulatedGraphs(),
        batch_sizes=None,
        compile_layers={"backend": counting},
    )
    with torch.inference_mode():
        for batch in (2, 3, 5, 8):
            got = tiny.answer(graphed, batch, seed=batch)
            with graphed.original() as model:
                want = tiny.answer(model, batch, seed=batch)
            assert relative_error(got, want) <= 1e-6, batch
    assert graphed.stats.replays == 4 and graphed.stats.eager_total == 0
    assert counting.compiled <= 2
    graphed.unwrap()


@pytest.mark.slow
def test_an_audio_encoders_compiled_layers_serve_four_clip_counts(fresh_dynamo: None) -> None:
    from test_audio_encoders import features, whisper_config

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    encoder = transformers.WhisperModel(whisper_config(encoder_layers=3)).encoder.eval()
    counting = Counting()
    graphed = layergraph.wrap(
        encoder, backend=SimulatedGraphs(), batch_sizes=None, compile_layers={"backend": counting}
    )
    with torch.inference_mode():
        for clips in (2, 3, 5, 8):
            x = features(clips, seed=clips)
            with graphed.original() as original:
                want = original(x).last_hidden_state
            assert relative_error(graphed(x).last_hidden_state, want) <= 1e-6, clips
    assert graphed.stats.replays == 4 and counting.compiled == 1


@pytest.mark.slow
def test_a_packed_towers_opaque_attention_compiles_no_version_per_budget(
    fresh_dynamo: None,
) -> None:
    """SigLIP2 NaFlex's routed attention is one operator to the compiler (``opaque_attention``):
    once its graphs' layers and its eager calls' have their versions, further budgets compile
    nothing, and each replay equals eager."""
    pytest.importorskip("transformers")
    from test_siglip2_adapter import check, tower

    model = tower()
    counting = Counting()
    graphed = layergraph.wrap(
        model,
        backend=SimulatedGraphs(),
        batch_sizes=[32, 64, 96, 128],
        compile_layers={"backend": counting},
    )
    compiled = []
    for grids in ([(4, 4)], [(6, 6), (3, 4)], [(8, 8), (4, 4)], [(8, 8), (6, 8), (2, 2)]):
        check(graphed, model, grids, patches=64)
        compiled.append(counting.compiled)
    assert graphed.stats.graphs == 4 and graphed.stats.replays == 4
    assert compiled[1] == compiled[2] == compiled[3], compiled


@pytest.mark.quick
def test_the_recorded_backend_is_the_backend_asked_for() -> None:
    """``compile_layers``'s settings reach the backend that compiles: Inductor by default with
    its mode and options, another backend by name; Dynamo reads Inductor's name and settings
    through the wrapper; ``guard_filter_fn`` stays ``torch.compile``'s."""
    from layergraph.compiling import RecordedBackend, _recorded

    default = _recorded({"dynamic": True, "options": {"coordinate_descent_tuning": True}})
    backend = default["backend"]
    assert isinstance(backend, RecordedBackend) and default["dynamic"] is True
    assert backend.compiler_name == "inductor"
    assert backend.get_compiler_config()["coordinate_descent_tuning"] is True
    assert "options" not in default

    def keep(entries: Any) -> list[bool]:
        return [True] * len(entries)

    named = _recorded({"backend": "aot_eager", "options": {"guard_filter_fn": keep}})
    assert named["backend"].compiler_name == "aot_eager"
    assert named["options"] == {"guard_filter_fn": keep}
    compiled = torch.compile(lambda x: x * 2 + 1, **named)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 3.0))


@pytest.mark.slow
def test_a_windowed_towers_compiled_layers_compile_one_version_for_every_budget(
    fresh_dynamo: None,
) -> None:
    """Qwen2.5-VL's full-attention and windowed layers hand their attention, with the
    boundaries they were given, to one operator (``opaque_attention``), which tells windows from
    frames at run time: compiled layers chosen by measurement compile once for every layer and
    token budget, and each replay equals eager."""
    pytest.importorskip("transformers")
    from test_qwen2_vl_adapter import check, tower

    model = tower()
    counting = Counting()
    graphed = layergraph.wrap(
        model,
        backend=SimulatedGraphs(
            lambda rows: 10.0, lambda rows: 1.0, compiled_replay_ms=lambda rows: 0.5
        ),
        batch_sizes=[64, 128, 192, 256],
        compile_layers={"auto": True, "background": True, "backend": counting},
    )
    for grids in ([(1, 8, 8)], [(1, 8, 12)], [(1, 12, 16)], [(1, 16, 16)]):
        check(graphed, model, grids)  # the budget's graph as built
        assert graphed.finish_compiling(timeout=300)
        check(graphed, model, grids)  # captured again with compiled layers, measured
    fusion = graphed.stats.fusion
    assert [choice.compiled for choice in fusion.values()] == [True] * 4, fusion
    assert counting.compiled == 1
