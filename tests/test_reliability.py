"""Reliability on the CPU: model changes, memory faults, bounded graphs, threads, debug checks.

Graphs are simulated (:class:`layergraph.testing.SimulatedGraphs`): a replay recomputes from
the static buffers, so a graph that kept stale state would give wrong answers here too.
Tolerance: float32 on the same kernels, 1e-5 absolute.
"""

from __future__ import annotations

import threading
import unittest.mock
import warnings
import weakref
from typing import Any

import pytest
import torch
from host_tensors import IndexedOnHost
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import layergraph
import layergraph.guards
from layergraph import GraphMismatchError
from layergraph.graphs import GraphCaptureError
from layergraph.runner import CaptureFailedWarning
from layergraph.testing import SimulatedGraphs

ATOL = 1e-5


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()


def wrap(model: nn.Module, backend: Any = None, **options: Any) -> layergraph.GraphedModule:
    return layergraph.wrap(
        model, adapter="sequential", backend=backend or SimulatedGraphs(), **options
    )


def check(
    graphed: layergraph.GraphedModule, model: nn.Module, batch: int, dtype: Any = None
) -> None:
    x = torch.randn(batch, 8, dtype=dtype or torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), model(x), atol=ATOL, rtol=0)


def test_reallocated_parameters_drop_the_graphs_and_recapture() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[4])
    check(graphed, model, 3)
    model.double()
    check(graphed, model, 3, torch.float64)
    assert graphed.stats.invalidations == 1
    model.float()
    check(graphed, model, 3)
    assert graphed.stats.invalidations == 2 and graphed.stats.eager_total == 0


def test_load_state_dict_with_assign_is_detected() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[4])
    check(graphed, model, 4)
    fresh = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)
    check(graphed, model, 4)
    assert graphed.stats.invalidations == 1


def test_a_replaced_module_is_detected() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[4])
    check(graphed, model, 2)
    model[2] = nn.Linear(16, 8)
    check(graphed, model, 2)
    assert graphed.stats.invalidations == 1


def test_in_place_weight_updates_keep_the_graphs() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[4])
    check(graphed, model, 4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    check(graphed, model, 4)
    assert graphed.stats.invalidations == 0 and graphed.stats.captures == 1


class OutOfMemoryGraphs(SimulatedGraphs):
    """Runs out of memory when capturing batches larger than ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def capture(self, fn: Any, pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        graph, output = super().capture(fn, pool, warmup_runs)
        if output.shape[0] > self.limit:
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return graph, output


def test_out_of_memory_at_capture_leaves_the_model_working() -> None:
    model = stack()
    backend = OutOfMemoryGraphs(limit=4)
    graphed = wrap(model, backend=backend, batch_sizes=[2, 8])
    check(graphed, model, 2)
    check(graphed, model, 7)
    check(graphed, model, 7)
    stats = graphed.stats
    assert stats.failed_captures == 1 and backend.memory_releases == 1
    assert stats.eager_calls == {
        "capture of (batch=8, sequence=float32[8]) ran out of device memory": 2
    }
    check(graphed, model, 2)
    assert graphed.stats.graphs == 1 and graphed.stats.replays == 2


class Flaky(nn.Module):
    """Doubles its input, but raises at the calls numbered in ``failing``; keeps a weak
    reference to the tensor it made in the call that failed."""

    def __init__(self, *failing: int) -> None:
        super().__init__()
        self.failing = failing
        self.calls = 0
        self.made: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        doubled = x * 2
        if self.calls in self.failing:
            self.made.append(weakref.ref(doubled))
            raise RuntimeError(f"layer failed at call {self.calls}")
        return doubled


def test_an_error_inside_a_layer_during_warm_up_is_the_models_and_raised() -> None:
    """Two warm-up runs come first, then the capture; the layer fails in the second warm-up,
    an eager run: that is the model's error, raised as it is, and nothing is recorded."""
    flaky = Flaky(2)
    graphed = wrap(nn.Sequential(flaky).eval(), batch_sizes=[2])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="layer failed at call 2") as failure:
            graphed(torch.randn(2, 3))
        assert graphed.stats.graphs == 0 and graphed.stats.failed_captures == 0
        assert failure.value.__traceback__ is not None
        assert flaky.made[0]() is None, "the error kept a tensor of the failed capture alive"
        x = torch.randn(2, 3)
        torch.testing.assert_close(graphed(x), x * 2)
    assert graphed.stats.graphs == 1


def test_an_error_inside_a_layer_during_capture_runs_the_call_eagerly() -> None:
    """The layer fails in the capture (its third run) alone: the call is answered eagerly, the
    key is marked failed with the layer's error, warned about once, and never captured again."""
    flaky = Flaky(3)
    graphed = wrap(nn.Sequential(flaky).eval(), batch_sizes=[2])
    x = torch.randn(2, 3)
    with torch.no_grad(), pytest.warns(layergraph.runner.CaptureFailedWarning) as recorded:
        torch.testing.assert_close(graphed(x), x * 2)
        torch.testing.assert_close(graphed(x), x * 2)
    warned = [w for w in recorded if w.category is layergraph.runner.CaptureFailedWarning]
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "RuntimeError: layer failed at call 3 (in Flaky.forward" in message
    assert warned[0].filename == __file__
    assert flaky.made[0]() is None, "the failed capture left a tensor alive"
    stats = graphed.stats
    assert stats.graphs == 0 and stats.captures == 0 and stats.failed_captures == 1
    assert stats.served == {(2, "eager"): 2}
    ((reason, count),) = stats.eager_calls.items()
    assert count == 2 and reason.startswith("capture of (batch=2, sequence=float32[3]) failed")
    assert flaky.calls == 5, "the failed key was captured again"


def test_a_failed_capture_whose_eager_call_fails_raises_the_eager_error() -> None:
    """The layer fails in the capture and in the eager call that stands in for it: the eager
    call's error is the caller's."""
    graphed = wrap(nn.Sequential(Flaky(3, 4)).eval(), batch_sizes=[2])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", layergraph.runner.CaptureFailedWarning)
        with pytest.raises(RuntimeError, match="layer failed at call 4"):
            graphed(torch.randn(2, 3))


def test_validate_raises_the_error_of_a_failed_capture() -> None:
    flaky = Flaky(3)
    graphed = wrap(nn.Sequential(flaky).eval(), batch_sizes=[2], validate=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="layer failed at call 3"):
            graphed(torch.randn(2, 3))
    assert flaky.made[0]() is None
    assert graphed.stats.graphs == 0 and graphed.stats.failed_captures == 0


def test_an_input_the_model_refuses_raises_the_models_error() -> None:
    """An input of the wrong width fails in the warm-up runs, as eagerly: the model's error."""
    graphed = wrap(stack(), batch_sizes=[2])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            graphed(torch.randn(2, 5))
    assert graphed.stats.failed_captures == 0


class ReadsOnTheHostAt(nn.Module):
    """Reads a value on the host when the batch is ``batch``, which a capture refuses; an eager
    call on the CPU does not mind."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.batch:
            return x * float(x.abs().max().item() > 0)
        return x


@pytest.mark.parametrize("first", [2, 3], ids=["after-a-graph", "first-capture"])
def test_other_keys_capture_and_replay_after_a_failed_capture(first: int) -> None:
    """Batch 3's capture fails, before or after batch 2's graph was captured into the pool:
    batch 3 runs eagerly, and batches 2 and 4 are captured into the pool and replay."""
    model = nn.Sequential(*stack(), ReadsOnTheHostAt(3)).eval()
    backend = SimulatedGraphs()
    graphed = wrap(model, backend=backend, batch_sizes=None)
    order = [first, 5 - first, 4, 2, 3, 4]  # 2 and 3 in the order chosen, then again
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        pool_bytes = []
        for batch in order:
            check(graphed, model, batch)
            pool_bytes.append(graphed.stats.pool_bytes)
    line = ReadsOnTheHostAt.forward.__code__.co_firstlineno + 2
    assert len(warned) == 1 and str(warned[0].message).startswith(
        "capture of (batch=3, sequence=float32[8]) failed: CaptureUnsafeOperation: "
        "Tensor.item reads a tensor's value on the host (.item(), bool(t), int(t)): a CUDA "
        "graph cannot capture it (it waits for the GPU); compute it before the captured "
        "region, or pass the result in as an input (in ReadsOnTheHostAt.forward "
        f"(test_reliability.py:{line})); calls of this shape run eagerly"
    )
    stats = graphed.stats
    assert sorted(key.batch for key in graphed.keys) == [2, 4]
    assert stats.captures == 2 and backend.captures == 2 and stats.failed_captures == 1
    assert stats.served == {(2, "graph"): 2, (4, "graph"): 2, (3, "eager"): 2}
    row = 8 * 4  # bytes of one output row of float32[8]
    assert pool_bytes[-1] == (2 + 4) * row and pool_bytes[order.index(3)] == 2 * row * (first == 2)


class FailsMidCapture(SimulatedGraphs):
    """A backend whose capture of ``batch`` rows fails as a GPU's does at a synchronisation:
    after the warm-up runs, with the capture abandoned and nothing added to the pool."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def capture(self, fn: Any, pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        output = None
        for _ in range(warmup_runs):
            output = fn()
        if output.shape[0] == self.batch:
            error = RuntimeError(
                "CUDA error: operation not permitted when stream is capturing\n"
                "Search for `cudaErrorStreamCaptureUnsupported' in the CUDA documentation"
            )
            raise GraphCaptureError.caused_by(error) from error
        return super().capture(fn, pool, warmup_runs)


def test_a_backend_failing_mid_capture_leaves_the_other_graphs_serving() -> None:
    model = stack()
    backend = FailsMidCapture(batch=8)
    graphed = wrap(model, backend=backend, batch_sizes=[2, 8])
    with pytest.warns(layergraph.runner.CaptureFailedWarning, match="not permitted when stream"):
        for batch in (2, 7, 7, 2):
            check(graphed, model, batch)
    stats = graphed.stats
    (reason,) = stats.eager_calls
    assert reason == (
        "capture of (batch=8, sequence=float32[8]) failed: RuntimeError: CUDA error: operation "
        "not permitted when stream is capturing"
    )
    assert stats.served == {(2, "graph"): 2, (7, "eager"): 2}
    assert stats.failed_captures == 1 and stats.graphs == 1 and backend.memory_releases == 0
    graphed.unwrap()
    ahead = wrap(model, backend=FailsMidCapture(batch=8), batch_sizes=[2, 8])
    with torch.no_grad(), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=r"cannot capture graphs: capture of \(batch=8"):
            ahead.capture(torch.randn(2, 8), progress=False)
    assert [w.category for w in warned] == [layergraph.runner.CaptureFailedWarning]


class WrongAfterCaptures(SimulatedGraphs):
    """Graphs captured after the first ``good`` replay wrongly, as a graph reading a stale
    buffer would."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    def capture(self, fn: Any, pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        graph, output = super().capture(fn, pool, warmup_runs)
        graph.wrong = self.captures > self.good
        return graph, output

    def replay(self, graph: Any) -> None:
        super().replay(graph)
        if graph.wrong:
            graph.output.add_(1.0)


def test_a_graph_captured_again_after_eviction_is_validated_again() -> None:
    model = stack()
    graphed = wrap(
        model, backend=WrongAfterCaptures(good=2), batch_sizes=None, max_graphs=1, validate=True
    )
    check(graphed, model, 2)
    for _ in range(2):
        check(graphed, model, 3)  # seen twice, more often than 2's graph was used: evicts it
    for _ in range(2):
        check(graphed, model, 2)  # eager until seen more often than 3's graph was used
    with pytest.raises(GraphMismatchError, match="batch 2"):
        check(graphed, model, 2)
    assert graphed.stats.evictions == 2 and graphed.stats.graphs == 0


class OutOfMemoryOnce(SimulatedGraphs):
    """Runs out of memory at the first capture of more than 4 rows."""

    failed = False

    def capture(self, fn: Any, pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        graph, output = super().capture(fn, pool, warmup_runs)
        if output.shape[0] > 4 and not self.failed:
            self.failed = True
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return graph, output


def test_a_failed_capture_is_tried_again_once_the_model_changed() -> None:
    """The failure is about the model as it was; no graph was left when it changed."""
    model = stack()
    graphed = wrap(model, backend=OutOfMemoryOnce(), batch_sizes=[8])
    check(graphed, model, 7)
    assert graphed.stats.failed_captures == 1 and graphed.stats.graphs == 0
    model._apply(torch.clone)  # what to() runs: every parameter re-allocated
    check(graphed, model, 7)
    stats = graphed.stats
    assert stats.graphs == 1 and stats.replays == 1 and stats.eager_total == 1


def test_a_shape_displaces_the_least_used_graph_only_once_seen_more_often() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=None, max_graphs=2)
    for batch in (1, 2, 1, 3):
        check(graphed, model, batch)
    assert sorted(key.batch for key in graphed.keys) == [1, 2]  # 3, seen once, runs eagerly
    check(graphed, model, 3)  # seen twice: displaces 2 (used once), not 1 (used twice)
    assert sorted(key.batch for key in graphed.keys) == [1, 3]
    stats = graphed.stats
    assert stats.evictions == 1 and stats.captures == 3
    (reason,) = stats.eager_calls
    assert stats.eager_calls[reason] == 1 and "max_graphs" in reason


def test_more_sizes_than_graphs_do_not_thrash() -> None:
    """3000 calls of 12 sizes with room for 4 graphs: a few captures, not one per call."""
    model = stack()
    graphed = wrap(model, batch_sizes=None, max_graphs=4)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3000):
        batch = int(torch.randint(1, 13, (1,), generator=generator))
        with torch.no_grad():
            graphed(torch.randn(batch, 8))
    stats = graphed.stats
    assert stats.graphs == 4 and stats.captures <= 60, stats
    assert stats.replays + stats.eager_total == 3000


def test_a_shape_is_captured_only_after_it_was_seen_enough() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=None, capture_after=3)
    for _ in range(4):
        check(graphed, model, 5)
    stats = graphed.stats
    assert stats.eager_calls == {"shape not yet seen 3 times (capture_after)": 2}
    assert stats.captures == 1 and stats.replays == 2


def test_a_stream_of_odd_shapes_keeps_memory_bounded() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=None, max_graphs=4, capture_after=2)
    for batch in range(1, 60):
        check(graphed, model, batch)
    assert graphed.stats.graphs == 0
    for batch in [5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 5]:
        check(graphed, model, batch)
    assert graphed.stats.graphs == 4 and graphed.stats.evictions == 0  # 9 is used less


def test_debug_mode_notices_a_moved_buffer() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[2], debug=True)
    check(graphed, model, 2)
    (entry,) = graphed.graphs
    entry.buffers.inputs[0].set_(torch.zeros(2, 8))
    with torch.no_grad(), pytest.raises(RuntimeError, match="no longer have their captured"):
        graphed(torch.randn(2, 8))


def test_moves_are_noticed_where_they_happen_and_the_rest_in_debug_mode() -> None:
    """to() and its kin are counted as they run, so a call reads no address unless something
    moved; a parameter's data set by hand is not counted, and debug mode names it."""
    model = stack()
    graphed = wrap(model, batch_sizes=[2])
    check(graphed, model, 2)
    with unittest.mock.patch.object(
        layergraph.guards, "addresses", side_effect=AssertionError("read")
    ):
        check(graphed, model, 2)  # nothing moved: no address is read
    model.half().float()
    check(graphed, model, 2)
    assert graphed.stats.invalidations == 1
    check(graphed, model, 2)  # the moved tensors are watched now: nothing moved since
    assert graphed.stats.invalidations == 1 and graphed.stats.captures == 2
    debugged = wrap(stack(), batch_sizes=[2], debug=True)
    check(debugged, debugged.module, 2)
    weight = debugged.module[0].weight
    weight.data = weight.data.clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match="no longer have their captured"):
        debugged(torch.randn(2, 8))


def test_empty_and_non_tensor_inputs_get_clear_errors() -> None:
    graphed = wrap(stack())
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"empty batch: .*\(0, 8\)"):
            graphed(torch.randn(0, 8))
        with pytest.raises(ValueError, match="the call has no tensor argument"):
            graphed("not an image")
    assert graphed.stats.graphs == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"static_output": "yes"}, "static_output must be True or False, got 'yes'"),
        ({"validate": 1}, "validate must be True or False, got 1"),
        ({"warm_start": 3}, r"warm_start must be the path .* of a file written by save_warm_start"),
    ],
)
def test_a_wrong_option_type_is_refused_naming_what_it_takes(options: dict, message: str) -> None:
    model = stack()
    with pytest.raises(TypeError, match=message):
        layergraph.wrap(model, adapter="sequential", backend=SimulatedGraphs(), **options)
    assert layergraph.wrap(model, adapter="sequential").unwrap() is model  # nothing left behind


def test_threads_calling_one_wrapped_model_get_their_own_answers() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[1, 2, 4, 8])
    wrong: list[int] = []

    def worker(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for i in range(50):
            x = torch.randn(1 + (seed + i) % 8, 8, generator=generator)
            with torch.no_grad():
                if not torch.allclose(graphed(x), model(x), atol=ATOL, rtol=0):
                    wrong.append(seed)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert graphed.stats.replays == 400


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True),
    batch=st.integers(1, 30),
)
def test_any_bucket_list_and_batch_give_eager_results(sizes: list[int], batch: int) -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=sizes)
    check(graphed, model, batch)
    stats = graphed.stats
    assert stats.eager_total == 0
    assert all(key.batch in sizes for key in graphed.keys)
    assert stats.split_calls == (1 if batch > max(sizes) else 0)


def test_static_output_with_a_split_batch_keeps_every_chunk() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[2], static_output=True)
    x = torch.randn(5, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(graphed(x), model(x), atol=ATOL, rtol=0)
    assert graphed.stats.split_calls == 1 and graphed.stats.overwritten_outputs == 0


def test_reassigned_parameters_before_any_capture_refresh_the_checks() -> None:
    model = stack()
    graphed = wrap(model, batch_sizes=[2])
    model.load_state_dict({k: v.double() for k, v in model.state_dict().items()}, assign=True)
    check(graphed, model, 2, torch.float64)
    assert graphed.stats.eager_total == 0 and graphed.stats.invalidations == 0


EVENTS = st.one_of(
    st.tuples(st.just("call"), st.integers(1, 9)),
    st.tuples(st.sampled_from(["move weights", "release", "fail next capture"]), st.just(0)),
)


class FailOnRequest(SimulatedGraphs):
    """Fails the next capture, inside the captured function, when asked to."""

    fail_next = False

    def capture(self, fn: Any, pool: Any, warmup_runs: int) -> tuple[Any, Any]:
        if not self.fail_next:
            return super().capture(fn, pool, warmup_runs)
        self.fail_next = False

        def failing() -> Any:
            raise RuntimeError("layer failed during capture")

        return super().capture(failing, pool, 0)


@settings(max_examples=40, deadline=None)
@given(events=st.lists(EVENTS, min_size=1, max_size=12))
def test_any_sequence_of_calls_changes_and_faults_keeps_serving(
    events: list[tuple[str, int]],
) -> None:
    """Calls between model changes, releases and failed captures all match eager, and only the
    key whose capture failed runs eagerly.

    The backend keeps PyTorch's pool rule, so a runner that captured into a pool drained by
    one of these events would fail here.
    """
    model = stack()
    backend = FailOnRequest()
    graphed = wrap(model, backend=backend, batch_sizes=[2, 4, 8], max_graphs=3)
    for event, batch in events:
        if event == "call":
            check(graphed, model, batch)
        elif event == "move weights":
            model._apply(torch.clone)  # what to() runs: every parameter re-allocated
        elif event == "release":
            graphed.release()
        elif 8 not in [key.batch for key in graphed.keys]:
            backend.fail_next = True
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                check(graphed, model, 8)
            # No capture was tried if batch 8's capture had failed since the last change.
            assert len(warned) == (0 if backend.fail_next else 1)
            assert all("layer failed during capture" in str(w.message) for w in warned)
            backend.fail_next = False
    failed = "capture of (batch=8, sequence=float32[8]) failed: RuntimeError: layer failed"
    assert all(reason.startswith(failed) for reason in graphed.stats.eager_calls)


class FillsWith(nn.Module):
    """Zeroes the negative values with ``x.masked_fill(mask, value)``, ``value`` a number, a
    one-value tensor of the device (CUDA's kernel reads it on the host: a wait) or one made on
    the host (read there without a wait)."""

    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = {
            "device tensor": lambda: x.new_zeros(()),
            "host tensor": lambda: torch.zeros((), dtype=x.dtype),
            "number": lambda: 0.0,
        }
        return x.masked_fill(x < 0, values[self.value]())


@pytest.mark.parametrize("value", ["device tensor", "host tensor", "number"])
def test_a_masked_fill_with_a_device_tensor_value_is_what_a_capture_refuses(value: str) -> None:
    model = nn.Sequential(*stack(), FillsWith(value)).eval()
    graphed = wrap(model, backend=SimulatedGraphs(), batch_sizes=[2])
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        check(graphed, model, 2)
    refused = value == "device tensor"
    assert graphed.stats.failed_captures == int(refused)
    if refused:
        assert "fills with a device tensor's value" in str(warned[0].message)


def test_a_capture_refused_at_a_copy_from_the_host_is_made_again_on_the_device() -> None:
    model = nn.Sequential(*stack(), IndexedOnHost("arange", 8)).eval()
    graphed = wrap(model, batch_sizes=[4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no capture failure is reported
        for batch in (4, 3, 4):
            check(graphed, model, batch)
    stats = graphed.stats
    assert stats.failed_captures == 0 and stats.eager_total == 0 and stats.replays == 3


def test_a_copy_from_the_host_that_cannot_be_made_on_the_device_is_served_eagerly() -> None:
    model = nn.Sequential(*stack(), IndexedOnHost("tensor", 8)).eval()
    graphed = wrap(model, batch_sizes=[4])
    with pytest.warns(CaptureFailedWarning, match="index tensor made on the host"):
        check(graphed, model, 4)
    check(graphed, model, 4)
    assert graphed.stats.failed_captures == 1 and graphed.stats.eager_total == 2


def test_the_faithful_replay_refuses_what_reaches_the_device_from_the_host() -> None:
    weight = nn.Parameter(torch.randn(10, 4))
    backend = SimulatedGraphs()

    def indexes() -> torch.Tensor:
        return weight[torch.arange(5)]

    def moves() -> torch.Tensor:
        return weight[:5] * torch.arange(5).to(weight.device)[:, None]

    def beside() -> torch.Tensor:
        return weight[:5] + torch.ones(5, 4)

    def made_on_device_or_read_on_host() -> torch.Tensor:
        count = int(torch.arange(3).sum().item())  # the host's values, read on the host
        scale = torch.tensor(2.0)  # a number beside the device's tensors
        return weight[torch.arange(5, device=weight.device)] * scale + count

    for refused, what in ((indexes, "an index tensor"), (moves, "a tensor"), (beside, "a tensor")):
        with pytest.raises(GraphCaptureError, match=f"copies {what} made on the host"):
            backend.capture(refused, backend.new_pool(), 1)
    graph, output = backend.capture(made_on_device_or_read_on_host, backend.new_pool(), 1)
    with torch.no_grad():
        weight.add_(1.0)
    backend.replay(graph)
    torch.testing.assert_close(output, weight[:5] * 2.0 + 3, atol=ATOL, rtol=0)
