"""Random streams through a Pixtral tower wrapped by the pixtral adapter.

On the CPU through simulated graphs whose costs make every way win somewhere: eager pays
``launches`` ms per call, a replay a third of that, and both pay per token, so a budget's graph
is kept or dropped, a call goes to its own budget, a larger one, is split by images or runs
eagerly. Calls hold one to five images of random sizes in pixels (sides that are not multiples
of the patch, far from square, one patch, and one image larger than every budget), padded to
a random size at least the largest, with random pixels in the padding; calls select hidden
states as VLMs do, or none. Budgets are learnt, given or exact; few graphs are allowed. Every
answer must equal the unwrapped tower's on the same input within 1e-4 relative error
(float32), in the last hidden state and every hidden state selected.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packed_helpers import wrap_for_stream
from torch import nn

import layergraph
from layergraph.testing import SimulatedGraphs

pytest.importorskip("transformers")
from test_pixtral_adapter import Sizes, assert_equal_outputs, call, pixtral, tower

LARGEST = 128
"""The largest budget, learnt or given: a call above it is split by images."""
BIG = (24, 26)
"""An image of 156 patches, above every budget: its calls run eagerly, with the reason."""
SIZES = st.one_of(
    st.tuples(st.integers(2, 17), st.integers(2, 17)),
    st.sampled_from([(2, 2), (2, 80), (80, 2), (5, 61), (19, 14), BIG]),
)
SELECTIONS = st.sampled_from([None, -1, -2, True, [0, -1]])


@functools.cache
def model() -> nn.Module:
    """The tower, built once (wrapping and unwrapping leave it as it was)."""
    return tower()


def answer(graphed: Any, inputs: dict[str, torch.Tensor], selected: Any) -> Any:
    """The wrapped tower's output on ``inputs``, copied out of any graph buffer."""
    out = graphed(**inputs, output_hidden_states=selected)
    out.last_hidden_state = out.last_hidden_state.clone()
    if out.hidden_states is not None:
        out.hidden_states = tuple(None if h is None else h.clone() for h in out.hidden_states)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=st.lists(
        st.tuples(st.lists(SIZES, min_size=1, max_size=5), SELECTIONS), min_size=2, max_size=6
    ),
    extra=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=6, max_size=6),
    budgets=st.sampled_from(["auto", (32, 64, LARGEST), None]),
    max_graphs=st.integers(1, 3),
    launches=st.sampled_from([0.0, 2.0, 8.0]),
    static_output=st.booleans(),
    validate=st.booleans(),
)
def test_every_answer_equals_the_towers(
    stream: list[tuple[Sizes, Any]],
    extra: list[tuple[int, int]],
    budgets: Any,
    max_graphs: int,
    launches: float,
    static_output: bool,
    validate: bool,
) -> None:
    tower = model()
    graphed = wrap_for_stream(
        tower,
        pixtral.PixtralAdapter(budget_step=32, max_tokens=LARGEST),
        budgets,
        launches,
        max_graphs=max_graphs,
        static_output=static_output,
        validate=validate,
    )
    try:
        for (sizes, selected), (more_rows, more_columns) in zip(stream, extra):
            padded = (
                max(h for h, _ in sizes) + more_rows,
                max(w for _, w in sizes) + more_columns,
            )
            inputs = call(sizes, padded)
            with torch.inference_mode():
                got = answer(graphed, inputs, selected)
                with graphed.original():
                    want = tower(**inputs, output_hidden_states=selected)
            assert_equal_outputs(got, want)
        stats = graphed.stats
        assert stats.graphs <= max_graphs
        if budgets is not None:
            assert all(key.batch <= LARGEST for key in graphed.keys)
        for reason in stats.eager_calls:
            if "above the largest token budget" in reason:
                assert any(BIG in sizes for sizes, _ in stream)
    finally:
        graphed.unwrap()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.tuples(st.integers(2, 13), st.integers(2, 13)), min_size=1, max_size=3))
def test_equal_token_totals_in_other_grids_replay_one_graph_with_their_own_layout(
    sizes: Sizes,
) -> None:
    """The same images reversed and transposed: equal token totals, other boundaries (unless
    the counts read the same both ways) and other grids, one budget's graph."""
    tower = model()
    graphed = layergraph.wrap(
        tower, adapter="pixtral", backend=SimulatedGraphs(), batch_sizes=[LARGEST]
    )
    try:
        for mix in (sizes, [(w, h) for h, w in reversed(sizes)]):
            inputs = call(mix)
            with torch.inference_mode():
                got = answer(graphed, inputs, None)
                with graphed.original():
                    want = tower(**inputs)
            assert_equal_outputs(got, want)
        assert graphed.stats.graphs == 1
        assert graphed.stats.replays == 2
    finally:
        graphed.unwrap()
