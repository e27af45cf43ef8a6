"""Random streams through a SigLIP2 NaFlex tower wrapped by the siglip2 adapter.

On the CPU through simulated graphs whose costs make every way win somewhere: eager pays
``launches`` ms per call, a replay a third of that, and both pay per token, so a budget's graph
is kept or dropped, a call goes to its own budget, a larger one, is split by images or runs
eagerly. Calls hold one to four images of random grids: one patch, grids far from square, grids
larger than the position table, and one image larger than every budget; each call pads its
images to a random number of patches. Budgets are learnt, given or exact; few graphs are
allowed. Every answer must equal the unwrapped tower's on the same fresh random input within
1e-4 relative error (float32) at every real patch and in the pooled features, and be zero at
every padding position.
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
from test_siglip2_adapter import Grids, assert_equal_outputs, call, siglip2, tower

LARGEST = 128
"""The largest budget, learnt or given: a call above it is split by images."""
BIG = (12, 12)
"""An image of 144 tokens, above every budget: its calls run eagerly, with the reason."""
GRIDS = st.one_of(
    st.tuples(st.integers(1, 8), st.integers(1, 8)),
    st.sampled_from([(1, 1), (1, 40), (40, 1), (2, 31), (9, 7), BIG]),
)


@functools.cache
def model() -> nn.Module:
    """The tower, built once (wrapping and unwrapping leave it as it was)."""
    return tower()


def answer(graphed: Any, inputs: dict[str, torch.Tensor]) -> Any:
    """The wrapped tower's output on ``inputs``, copied out of any graph buffer."""
    out = graphed(**inputs)
    out.last_hidden_state = out.last_hidden_state.clone()
    out.pooler_output = out.pooler_output.clone()
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=st.lists(st.lists(GRIDS, min_size=1, max_size=4), min_size=2, max_size=6),
    extra_patches=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    budgets=st.sampled_from(["auto", (32, 64, LARGEST), None]),
    max_graphs=st.integers(1, 3),
    launches=st.sampled_from([0.0, 2.0, 8.0]),
    static_output=st.booleans(),
    validate=st.booleans(),
)
def test_every_answer_equals_the_towers(
    stream: list[Grids],
    extra_patches: list[int],
    budgets: Any,
    max_graphs: int,
    launches: float,
    static_output: bool,
    validate: bool,
) -> None:
    tower = model()
    graphed = wrap_for_stream(
        tower,
        siglip2.Siglip2Adapter(budget_step=32, max_tokens=LARGEST),
        budgets,
        launches,
        observe_calls=0,
        max_graphs=max_graphs,
        static_output=static_output,
        validate=validate,
    )
    try:
        for grids, extra in zip(stream, extra_patches):
            inputs = call(grids, max(h * w for h, w in grids) + extra)
            with torch.inference_mode():
                got = answer(graphed, inputs)
                with graphed.original():
                    want = tower(**inputs)
            assert_equal_outputs(got, want, inputs)
        stats = graphed.stats
        assert stats.graphs <= max_graphs
        if budgets is not None:
            assert all(key.batch <= LARGEST for key in graphed.keys)
        for reason in stats.eager_calls:
            if "above the largest token budget" in reason:
                assert any(BIG in grids for grids in stream)
    finally:
        graphed.unwrap()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grids=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3))
def test_equal_token_totals_in_other_grids_replay_one_graph_with_their_own_layout(
    grids: Grids,
) -> None:
    """The same images reversed and transposed: equal token totals, other boundaries (unless
    the counts read the same both ways) and other grids, one budget's graph."""
    tower = model()
    graphed = layergraph.wrap(
        tower, observe_calls=0, adapter="siglip2", backend=SimulatedGraphs(), batch_sizes=[LARGEST]
    )
    try:
        for mix in (grids, [(w, h) for h, w in reversed(grids)]):
            inputs = call(mix)
            with torch.inference_mode():
                got = answer(graphed, inputs)
                with graphed.original():
                    want = tower(**inputs)
            assert_equal_outputs(got, want, inputs)
        assert graphed.stats.graphs == 1
        assert graphed.stats.replays == 2
    finally:
        graphed.unwrap()
