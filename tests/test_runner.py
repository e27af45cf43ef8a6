"""The runner's logic on the CPU, through the simulated graph backend.

Tolerance: the simulated replay recomputes the same float32 function on a padded batch; rows
of a linear stack are computed independently, so outputs agree to 1e-5 (absolute) at most.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import layergraph
import layergraph.runner
from layergraph import GraphMismatchError
from layergraph.compiling import CompileBudgetSpent
from layergraph.stats import GraphStats
from layergraph.testing import SimulatedGraphs

ATOL = 1e-5


def wrap_simulated(model: nn.Module, **options: Any) -> layergraph.GraphedModule:
    return layergraph.wrap(
        model, adapter=layergraph.SequentialAdapter(), backend=SimulatedGraphs(), **options
    )


@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8])
def test_graph_output_equals_eager_on_fresh_inputs(mlp_stack: nn.Sequential, batch: int) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[1, 4, 8])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)


def test_padding_uses_the_next_bucket_and_is_counted(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[2, 8])
    with torch.no_grad():
        out = graphed(torch.randn(5, 16))
    assert out.shape == (5, 16)
    assert [key.batch for key in graphed.keys] == [8]
    stats = graphed.stats
    assert (stats.captures, stats.replays, stats.padded_calls, stats.eager_total) == (1, 1, 1, 0)


def test_padding_rows_are_zeroed_between_calls() -> None:
    class Recorder(nn.Module):
        """Keeps the rows it was given in a buffer, written in place (by replays too)."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.full((4, 3), -1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.copy_(x)
            return x * 2

    recorder = Recorder()
    graphed = wrap_simulated(nn.Sequential(recorder).eval(), batch_sizes=[4])
    with torch.no_grad():
        graphed(torch.ones(4, 3))
        recorder.seen.fill_(-1.0)
        graphed(torch.ones(2, 3))
    assert graphed.stats.replays == 2
    assert torch.equal(recorder.seen, torch.tensor([[1.0] * 3] * 2 + [[0.0] * 3] * 2))


def test_batch_above_every_bucket_is_split_into_chunks(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[1, 4])
    x = torch.randn(10, 16)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert stats.split_calls == 1 and stats.replays == 3 and stats.padded_calls == 1
    assert sorted(key.batch for key in graphed.keys) == [4]


def test_exact_mode_captures_each_batch_and_respects_max_graphs(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=None, max_graphs=2)
    with torch.no_grad():
        for batch in (3, 5, 7, 3, 7):  # 7 displaces 5 once seen more often than 5 was used
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert stats.graphs == 2 and stats.replays == 4 and stats.captures == 3
    assert stats.evictions == 1 and stats.eager_total == 1
    assert sorted(key.batch for key in graphed.keys) == [3, 7]


def test_lazy_off_runs_uncaptured_keys_eagerly(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[2, 4], lazy=False)
    with torch.no_grad():
        graphed(torch.randn(2, 16))
        assert graphed.stats.graphs == 0
        keys = graphed.capture(torch.randn(1, 16), progress=False)
        graphed(torch.randn(3, 16))
    assert [key.batch for key in keys] == [4, 2]
    stats = graphed.stats
    assert stats.replays == 1 and stats.eager_total == 1
    (reason,) = stats.eager_calls
    assert "lazy capture is off" in reason and "batch=2" in reason


def test_new_sequence_gets_its_own_graph(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[4])
    with torch.no_grad():
        graphed(torch.randn(4, 16))
        graphed(torch.randn(4, 7, 16))
    assert graphed.stats.graphs == 2


def test_default_output_is_fresh_and_static_output_is_overwritten(
    mlp_stack: nn.Sequential,
) -> None:
    fresh = wrap_simulated(mlp_stack, batch_sizes=[2])
    a, b = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        kept = fresh(a)
        fresh(b)
        torch.testing.assert_close(kept, mlp_stack(a), atol=ATOL, rtol=0)
    fresh.unwrap()
    static = wrap_simulated(mlp_stack, batch_sizes=[2], static_output=True)
    with torch.no_grad():
        held = static(a)
        with pytest.warns(layergraph.runner.StaleOutputWarning, match="still referenced"):
            static(b)
        torch.testing.assert_close(held, mlp_stack(b), atol=ATOL, rtol=0)
    assert static.stats.overwritten_outputs == 1


class Pair(NamedTuple):
    doubled: torch.Tensor
    total: torch.Tensor


class PairModel(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> Pair:
        return Pair(x * 2 * scale, x.sum(dim=-1))


def test_output_type_is_kept_and_non_tensor_args_are_keyed() -> None:
    model = PairModel().eval()
    graphed = layergraph.wrap(
        model, adapter=_WholeModel(), backend=SimulatedGraphs(), batch_sizes=[4]
    )
    x = torch.randn(3, 5)
    with torch.no_grad():
        out = graphed(x, scale=3.0)
        other = graphed(x, scale=1.0)
    assert isinstance(out, Pair) and out.doubled.shape == (3, 5) and out.total.shape == (3,)
    torch.testing.assert_close(out.doubled, x * 6)
    torch.testing.assert_close(other.doubled, x * 2)
    assert graphed.stats.graphs == 2


class _WholeModel(layergraph.Adapter):
    name = "whole-model-test"

    def plan(self, model: nn.Module, context: Any = None) -> layergraph.CapturePlan:
        return layergraph.WholeForward(model)


def wrap_whole(model: nn.Module, **options: Any) -> layergraph.GraphedModule:
    return layergraph.wrap(model, adapter=_WholeModel(), backend=SimulatedGraphs(), **options)


class LossModel(nn.Module):
    """Scores, one row per input, and a loss averaged over the batch against ``labels``."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = x * 2
        return scores, (scores.sum(dim=-1) - labels).square().mean()


class TransposedModel(nn.Module):
    """One column per input: the batch is the last dimension."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (x + labels[:, None]).t()


@pytest.mark.parametrize(
    ("model", "problem"),
    [(LossModel(), "output 1 is 0-d"), (TransposedModel(), "output 0 has 5 rows for 4 inputs")],
    ids=["loss", "transposed"],
)
def test_outputs_not_one_row_per_input_are_never_padded(model: nn.Module, problem: str) -> None:
    """The labels are batched too, so the call looks batched; the padded call that captured
    the graph gets the eager answer as well."""
    graphed = wrap_whole(model.eval(), batch_sizes=[4])
    with torch.no_grad():
        for batch in (3, 4, 3):
            x, labels = torch.randn(batch, 5), torch.randn(batch)
            torch.testing.assert_close(graphed(x, labels), model(x, labels), atol=ATOL, rtol=0)
    stats = graphed.stats
    reason = f"outputs are not one row per input ({problem}): batch 3 is not padded"
    assert stats.eager_calls == {reason: 2}
    assert (stats.captures, stats.replays, stats.padded_calls) == (1, 1, 0)


def test_outputs_not_one_row_per_input_are_never_split() -> None:
    model = LossModel().eval()
    graphed = wrap_whole(model, batch_sizes=[1, 2])
    x, labels = torch.randn(5, 3), torch.randn(5)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x, labels), model(x, labels), atol=ATOL, rtol=0)
    stats = graphed.stats
    reason = "outputs are not one row per input (output 1 is 0-d): batch 5 is not split"
    assert stats.eager_calls == {reason: 1}
    assert (stats.split_calls, stats.replays, stats.captures) == (0, 0, 1)


def test_chunks_whose_outputs_are_not_one_row_per_input_are_not_joined() -> None:
    """A mean over 4 rows of 4 features has 4 rows: the graph of 4 takes it for one row per
    input. The chunk of 2 rows shows it is not; the call runs eagerly, never concatenated."""

    class Mean(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=0)

    graphed = wrap_whole(Mean().eval(), batch_sizes=[2, 4])
    x = torch.randn(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), x.mean(dim=0), atol=ATOL, rtol=0)
    reason = (
        "outputs are not one row per input (output 0 has 4 rows for 2 inputs): batch 6 is not split"
    )
    assert graphed.stats.eager_calls == {reason: 1} and graphed.stats.split_calls == 0


def test_split_values_other_than_tensors_must_agree_between_chunks() -> None:
    """A Python value in the output is fixed at capture: 4 in the graph of 4, 2 in that of 2."""

    class Counted(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x * 2, x.shape[0]

    graphed = wrap_whole(Counted().eval(), batch_sizes=[2, 4])
    x = torch.randn(6, 3)
    with torch.no_grad():
        doubled, rows = graphed(x)
    torch.testing.assert_close(doubled, x * 2)
    assert rows == 6
    reason = (
        "outputs are not one row per input (output 1 differs between chunks): batch 6 is not split"
    )
    assert graphed.stats.eager_calls == {reason: 1}


def test_a_vit_loss_from_batched_labels_is_never_padded() -> None:
    """transformers' classifier given ``labels`` returns a 0-d loss over the batch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=16,
        num_labels=5,
    )
    model = transformers.ViTForImageClassification(config).eval()
    graphed = wrap_whole(model, batch_sizes=[4])
    pixels, labels = torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2])
    with torch.no_grad():
        got = graphed(pixel_values=pixels, labels=labels)
        want = model(pixel_values=pixels, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    assert list(graphed.stats.eager_calls) == [
        "outputs are not one row per input (output 0 is 0-d): batch 3 is not padded"
    ]


def test_stale_output_warning_names_the_callers_line(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[2], static_output=True)
    with torch.no_grad(), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        held = graphed(torch.randn(2, 16))
        graphed(torch.randn(2, 16))
    assert held is not None
    (warning,) = [w for w in warned if w.category is layergraph.runner.StaleOutputWarning]
    assert warning.filename == __file__


def test_training_mode_runs_eagerly(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack)
    graphed.train()
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), mlp_stack(x), atol=0, rtol=0)
    assert graphed.stats.eager_calls == {"model is in training mode": 1}
    assert graphed.stats.graphs == 0


@pytest.mark.parametrize(
    ("x", "reason"),
    [
        (
            torch.randn(2, 16).double(),
            "input dtype torch.float64 differs from model dtype torch.float32",
        ),
        (torch.randn(2, 16).to("meta"), "input on meta, model on cpu"),
    ],
)
def test_inputs_unlike_the_model_run_eagerly(
    mlp_stack: nn.Sequential, x: torch.Tensor, reason: str
) -> None:
    """The eager run fails; the error names the mismatch first, the model's error chained."""
    graphed = wrap_simulated(mlp_stack)
    with torch.no_grad(), pytest.raises(ValueError, match=reason) as error:
        graphed(x)
    assert isinstance(error.value.__cause__, (RuntimeError, NotImplementedError))
    assert graphed.stats.eager_calls == {reason: 1}
    assert graphed.stats.graphs == 0


def test_gradients_enabled_runs_eagerly_with_autograd(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack)
    out = graphed(torch.randn(2, 16))
    assert out.requires_grad
    (reason,) = graphed.stats.eager_calls
    assert reason.startswith("gradients are enabled")
    mlp_stack.requires_grad_(False)
    graphed(torch.randn(2, 16))
    assert graphed.stats.replays == 1


def test_no_cuda_runs_eagerly_with_the_reason(mlp_stack: nn.Sequential) -> None:
    graphed = layergraph.wrap(mlp_stack, adapter="sequential")
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), mlp_stack(x), atol=0, rtol=0)
    if not torch.cuda.is_available():
        assert graphed.stats.eager_calls == {"CUDA is not available": 1}
    else:
        assert graphed.stats.eager_calls == {"model is on cpu; graphs need a cuda device": 1}


class CorruptingGraphs(SimulatedGraphs):
    """Replays that add an error, as a graph reading a stale buffer would."""

    def replay(self, graph: Any) -> None:
        super().replay(graph)
        graph.output.add_(1.0)


def test_validate_raises_with_largest_difference_and_drops_the_graph(
    mlp_stack: nn.Sequential,
) -> None:
    graphed = layergraph.wrap(
        mlp_stack, adapter="sequential", backend=CorruptingGraphs(), validate=True
    )
    with torch.no_grad(), pytest.raises(GraphMismatchError, match=r"largest absolute difference 1"):
        graphed(torch.randn(2, 16))
    assert graphed.stats.graphs == 0


def test_validate_passes_for_a_correct_graph(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, validate=True)
    with torch.no_grad():
        graphed(torch.randn(3, 16))
        graphed(torch.randn(3, 16))
    assert graphed.stats.replays == 2


def test_capture_is_largest_first_and_reports_keys(mlp_stack: nn.Sequential) -> None:
    backend = SimulatedGraphs()
    graphed = layergraph.wrap(
        mlp_stack, adapter="sequential", backend=backend, batch_sizes=[1, 2, 4, 8]
    )
    order: list[int] = []
    original = backend.capture

    def spy(fn: Any, pool: Any, warmup_runs: int) -> Any:
        graph, output = original(fn, pool, warmup_runs)
        order.append(output.shape[0])
        return graph, output

    backend.capture = spy  # type: ignore[method-assign]
    with torch.no_grad():
        keys = graphed.capture(torch.randn(3, 16), progress=False)
    assert order == [8, 4, 2, 1] and [k.batch for k in keys] == [8, 4, 2, 1]
    assert graphed.stats.pool_bytes == sum(b * 16 * 4 for b in (8, 4, 2, 1))


def test_capture_refuses_when_a_graph_cannot_serve(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack.train())
    with pytest.raises(RuntimeError, match="cannot capture graphs: model is in training mode"):
        graphed.capture(torch.randn(1, 16))


def test_a_failing_capture_leaves_nothing_behind() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 2:
                raise ValueError("too many rows")
            return x + 1

    graphed = wrap_simulated(nn.Sequential(Fails()).eval(), batch_sizes=[2, 4])
    with torch.no_grad():
        with pytest.raises(ValueError, match="too many rows"):
            graphed(torch.randn(3, 2))
        assert graphed.stats.graphs == 0
        torch.testing.assert_close(graphed(torch.randn(2, 2)).shape, torch.Size([2, 2]))
    assert graphed.stats.graphs == 1


def test_inference_mode_then_no_grad_share_graphs(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack, batch_sizes=[4])
    x = torch.randn(4, 16)
    with torch.inference_mode():
        first = graphed(x)
    with torch.no_grad():
        second = graphed(x)
    torch.testing.assert_close(first, second)
    assert graphed.stats.graphs == 1 and graphed.stats.replays == 2


def test_release_drops_graphs_and_unwrap_returns_the_model(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_simulated(mlp_stack)
    with torch.no_grad():
        graphed(torch.randn(2, 16))
    graphed.release()
    assert graphed.stats.graphs == 0
    assert graphed.unwrap() is mlp_stack


def test_attributes_fall_through_to_the_model(mlp_stack: nn.Sequential) -> None:
    mlp_stack.label = "stack"  # type: ignore[attr-defined]
    graphed = wrap_simulated(mlp_stack)
    assert graphed.label == "stack"
    with pytest.raises(AttributeError):
        graphed.missing_attribute  # noqa: B018


def test_wrap_rejects_bad_arguments(mlp_stack: nn.Sequential) -> None:
    with pytest.raises(TypeError, match="already wrapped"):
        layergraph.wrap(wrap_simulated(mlp_stack), adapter="sequential")
    with pytest.raises(TypeError, match=r"nn\.Module"):
        layergraph.wrap(lambda x: x, adapter="sequential")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options for an adapter object"):
        layergraph.wrap(mlp_stack, adapter=layergraph.SequentialAdapter(), stack="x")
    with pytest.raises(ValueError, match="max_graphs"):
        layergraph.wrap(mlp_stack, adapter="sequential", max_graphs=0)


def test_compile_layers_compiles_in_place_and_unwrap_undoes_it(mlp_stack: nn.Sequential) -> None:
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = mlp_stack(x)
        graphed = wrap_simulated(mlp_stack, compile_layers={"backend": "aot_eager"})
        assert all(layer._compiled_call_impl is not None for layer in mlp_stack)
        torch.testing.assert_close(graphed(x), expected, atol=ATOL, rtol=0)
    graphed.unwrap()
    assert all(layer._compiled_call_impl is None for layer in mlp_stack)


def test_compile_region_serves_captures_and_leaves_eager_calls_alone(
    mlp_stack: nn.Sequential,
) -> None:
    compiled: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    graphed = wrap_simulated(
        mlp_stack, batch_sizes=[4], compile_region={"backend": counting_backend}
    )
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = mlp_stack(x)
        graphed.capture(x, progress=False)
        assert len(compiled) == 1  # the whole stack, one graph, for the one shape
        torch.testing.assert_close(graphed(x), expected, atol=ATOL, rtol=0)
        before_eager = len(compiled)
        mlp_stack.train()
        torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
        mlp_stack.eval()
    assert len(compiled) == before_eager and graphed.stats.eager_calls
    assert all(layer._compiled_call_impl is None for layer in mlp_stack)


@pytest.mark.parametrize("setting", ["compile_layers", "compile_region"])
def test_every_captured_batch_size_gets_compiled_code(
    mlp_stack: nn.Sequential, setting: str
) -> None:
    """More shapes than Dynamo's default recompile limit (8), each called eagerly first (as a
    benchmark's reference would), are all captured running compiled code."""
    ran: set[int] = set()

    def recording_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        def run(*args: Any) -> Any:
            ran.update(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim())
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    sizes = list(range(1, 13))
    graphed = wrap_simulated(
        mlp_stack, batch_sizes=sizes, **{setting: {"backend": recording_backend}}
    )
    with torch.no_grad():
        for batch in sizes:
            with graphed.original() as original:
                original(torch.randn(batch, 16))
        ran.clear()
        graphed.capture(torch.randn(1, 16), progress=False)
        assert set(sizes) <= ran
        x = torch.randn(12, 16)
        torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    assert graphed.stats.graphs == len(sizes)
    assert torch._dynamo.config.recompile_limit == 8  # PyTorch's default, left as it is


@pytest.mark.parametrize("setting", ["compile_layers", "compile_region"])
@pytest.mark.parametrize(("seconds", "compiled_sizes"), [(None, [8, 4, 2]), (1e-9, [8]), (0.0, [])])
def test_compile_budget_caps_compilation(
    mlp_stack: nn.Sequential, setting: str, seconds: float | None, compiled_sizes: list[int]
) -> None:
    """Sizes are captured largest first; once the budget is spent, the sizes not compiled yet
    are captured uncompiled (each size compiled on its own, ``dynamic=False``: compiled layers'
    one version for every size is tests/test_compiled_layers.py's)."""
    compiled: list[int] = []
    ran: list[int] = []

    def batch_of(tensors: Any) -> int:  # the activation's rows; the weights have 16 or 32
        return next(
            t.shape[0]
            for t in tensors
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] < 16
        )

    def recording_backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
        compiled.append(batch_of(example))

        def run(*args: Any) -> Any:
            ran.append(batch_of(args))
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    graphed = wrap_simulated(
        mlp_stack,
        batch_sizes=[2, 4, 8],
        compile_budget=seconds,
        **{setting: {"backend": recording_backend, "dynamic": False}},
    )
    with torch.no_grad(), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        graphed.capture(torch.randn(1, 16), progress=False)
        assert sorted(set(ran), reverse=True) == sorted(set(compiled), reverse=True)
        assert sorted(set(ran), reverse=True) == compiled_sizes  # what the graphs hold
        for batch in (8, 3):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    assert graphed.stats.replays == 2
    budget = graphed.compile_budget
    assert budget.exhausted == (seconds is not None)
    assert (budget.spent > 0) == bool(compiled_sizes)
    spent_warnings = [w for w in warned if issubclass(w.category, CompileBudgetSpent)]
    assert len(spent_warnings) == (seconds is not None)
    assert all(w.filename == __file__ for w in spent_warnings), "not the caller's line"


def test_compile_budget_needs_compilation_and_seconds(mlp_stack: nn.Sequential) -> None:
    with pytest.raises(ValueError, match="compile_budget limits compile_layers or compile_region"):
        wrap_simulated(mlp_stack, compile_layers=False, compile_budget=10)
    with pytest.raises(ValueError, match="a number of seconds >= 0, got -1"):
        wrap_simulated(mlp_stack, compile_region=True, compile_budget=-1)
    assert wrap_simulated(mlp_stack).compile_budget.spent == 0


def test_compile_region_and_compile_layers_exclude_each_other(mlp_stack: nn.Sequential) -> None:
    with pytest.raises(ValueError, match="choose one"):
        wrap_simulated(mlp_stack, compile_layers=True, compile_region=True)


def test_compile_layers_needs_an_adapter_that_names_its_layers() -> None:
    with pytest.raises(ValueError, match="does not name"):
        layergraph.wrap(PairModel().eval(), adapter=_WholeModel(), compile_layers=True)


def test_a_model_error_in_training_mode_stays_the_models_own() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("from the model")

    graphed = wrap_simulated(nn.Sequential(Fails()))  # a new module is in training mode
    with pytest.raises(KeyError, match="from the model"):
        graphed(torch.randn(2, 3))
    assert graphed.stats.eager_calls == {"model is in training mode": 1}


def test_every_statistic_has_a_reference_docstring_of_its_own() -> None:
    griffe = pytest.importorskip("griffe")
    documented = griffe.load("layergraph.stats")["GraphStats"]
    fields = [field.name for field in dataclasses.fields(GraphStats)]
    assert [name for name in fields if not documented[name].docstring] == []


class _ReadsValues(nn.Module):
    """A layer that does what a CUDA stream capture refuses, chosen by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "mask":
            return x * x[x > 0].sum()
        if self.how == "item":
            return x * float(x.abs().max().item())
        if self.how == "nonzero":
            return x * len(torch.nonzero(x))
        return x * torch.repeat_interleave(x[:, 0].abs().long() + 1).numel()


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("mask", "boolean mask"),
        ("item", "reads a tensor's value on the host"),
        ("nonzero", "nonzero"),
        ("repeats", "without output_size"),
    ],
)
def test_a_capture_refuses_what_a_cuda_capture_refuses(how: str, named: str) -> None:
    """The refused operator fails the capture: the call runs eagerly, with the operator named in
    the warning and the reason; validate=True raises it instead."""
    from layergraph.runner import CaptureFailedWarning
    from layergraph.testing import CaptureUnsafeOperation

    model = nn.Sequential(nn.Linear(4, 4), _ReadsValues(how)).eval()
    graphed = wrap_simulated(model, batch_sizes=None)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        with pytest.warns(CaptureFailedWarning, match=named):
            torch.testing.assert_close(graphed(x), model(x))
        stats = graphed.stats
        assert stats.graphs == 0 and stats.pool_bytes == 0 and stats.failed_captures == 1
        ((reason, count),) = stats.eager_calls.items()
        assert count == 1 and "CaptureUnsafeOperation" in reason and named in reason
        with graphed.original() as original:  # the model itself is left as it was
            torch.testing.assert_close(original(x), model(x))
        graphed.unwrap()
        strict = wrap_simulated(model, batch_sizes=None, validate=True)
        with pytest.raises(CaptureUnsafeOperation, match=named):
            strict(x)
        strict.unwrap()
    lenient = layergraph.wrap(
        model, adapter=layergraph.SequentialAdapter(), backend=SimulatedGraphs(strict=False)
    )
    with torch.inference_mode():
        torch.testing.assert_close(lenient(x), model(x))  # the CPU itself has no such rule
    assert lenient.stats.replays == 1


class _AsksIfCapturing(nn.Module):
    """Records what ``torch.cuda.is_current_stream_capturing()`` answered at each call, as
    transformers' mask helpers ask it to choose their path."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:  # as transformers asks: a machine without a CUDA driver raises
            capturing = torch.cuda.is_current_stream_capturing()
        except Exception:
            capturing = False
        self.answers.append(capturing)
        return x * 2


def test_a_simulated_capture_says_a_stream_is_capturing_as_a_cuda_capture_does() -> None:
    asks = _AsksIfCapturing()
    graphed = wrap_simulated(nn.Sequential(nn.Linear(4, 4), asks).eval(), batch_sizes=None)
    with torch.inference_mode():
        graphed(torch.randn(2, 4))
    # warm-up runs, then the capture; a replay re-runs the function on the CPU, where a real
    # replay runs no Python, so only the capture's answer matters
    assert True in asks.answers and asks.answers[0] is False
    assert asks.answers.count(True) == 1
