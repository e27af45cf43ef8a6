"""Random streams through the packed towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5, GLM-4.1V and GLM-OCR.

On the CPU through simulated graphs whose costs make every way win somewhere: eager pays
``launches`` ms per call, a replay a third of that, and both pay per token, so a budget's graph
is kept or dropped, a call goes to its own budget, a larger one, is split by images or runs
eagerly. Calls hold one to three entries drawn from images smaller than a window, images of
several windows, one image larger than every budget (run eagerly, the rest of its call from
graphs), and two-frame videos (given to GLM-4.1V's tower as one row per frame, as its VLM
passes them); budgets are learnt, given or exact; few graphs are allowed. Every answer (the
merged features, the last hidden state and Qwen3-VL's and Qwen3-VL-MoE's deep-stack features)
must equal the unwrapped tower's on the same fresh random input within 1e-4 relative error
(float32).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packed_helpers import wrap_for_stream
from torch import nn
from torch.utils import _pytree as pytree

import layergraph
from layergraph.serving.budgets import (
    CAPTURE_COST,
    GRAPH_WORTH,
    PACKED_MAX_GRAPHS,
    REPLAN_GAIN,
    best_budgets,
    padding,
)
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

pytest.importorskip("transformers")
from test_glm4v_adapter import tower as glm_tower
from test_qwen2_vl_adapter import (
    ENTRIES,
    TOLERANCE,
    VISION_QWEN3,
    call,
    qwen2_vl,
    sharpen,
    tower,
)
from test_qwen3_5_adapter import tower as qwen3_5_tower
from test_qwen3_vl_moe_adapter import tower as qwen3_vl_moe_tower

KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "glm4v", "glm_ocr"]
LARGEST = 128
"""The largest budget, learnt or given: a call above it is split by images."""
BIG = (1, 16, 12)
"""An image of 192 tokens, above every budget: it runs eagerly, with the reason."""


@functools.cache
def model(kind: str) -> nn.Module:
    """The tower of ``kind``, built once (wrapping and unwrapping leave it as it was)."""
    if kind.startswith("glm"):
        return glm_tower(kind)
    if kind == "qwen3_5":
        return qwen3_5_tower(kind)
    if kind == "qwen3_vl_moe":
        return qwen3_vl_moe_tower()
    if kind != "qwen3_vl":
        return tower(kind)
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    return sharpen(Qwen3VLVisionModel(Qwen3VLVisionConfig(**VISION_QWEN3)).eval())


def entries(kind: str, grids: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``grids`` as the tower of ``kind`` is given them: GLM-4.1V's reads ``grid_thw``'s rows
    by frame, and its VLM passes a video as one row per frame."""
    if kind != "glm4v":
        return grids
    return [(1, h, w) for t, h, w in grids for _ in range(t)]


OPTION_GRIDS = ([(1, 4, 6), (1, 2, 2)], [(2, 4, 4), (1, 8, 8)])
"""Two calls for the speed options' tests: several images, and a video beside an image."""


SMALL_GRIDS = ([(1, 2, 4), (1, 2, 2)], [(2, 2, 2), (1, 4, 4)])
""":data:`OPTION_GRIDS`' kinds of call in fewer tokens, for kernels run by Triton's
interpreter, whose time grows with the tokens (one program per token)."""


def option_calls(
    kind: str, grids_of_calls: tuple[list[tuple[int, int, int]], ...] = OPTION_GRIDS
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Fresh inputs of ``grids_of_calls`` for the tower of ``kind``, and its own merged
    features for them, computed before anything is wrapped."""
    inputs = [call(entries(kind, grids)) for grids in grids_of_calls]
    with torch.inference_mode():
        want = [model(kind)(p, grid_thw=g).pooler_output for p, g in inputs]
    return inputs, want


def wrapped_with(kind: str, **options: Any) -> layergraph.GraphedModule:
    """The tower of ``kind`` wrapped by qwen2_vl with simulated graphs, every call served by a
    graph (``observe_calls=0``), and ``options``."""
    settings = dict(backend=SimulatedGraphs(), observe_calls=0, budget_step=32)
    return layergraph.wrap(model(kind), adapter="qwen2_vl", **{**settings, **options})


def check_answers(
    graphed: layergraph.GraphedModule,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    want: list[torch.Tensor],
    tolerance: float = TOLERANCE,
) -> None:
    """Each call's merged features from ``graphed`` within ``tolerance`` of ``want``."""
    with torch.inference_mode():
        for (pixels, grid), expected in zip(inputs, want):
            got = graphed(pixels, grid_thw=grid).pooler_output
            assert relative_error(got, expected) <= tolerance


def answer(output: Any) -> list[torch.Tensor]:
    """What a caller reads: merged features, the last hidden state (Qwen2-VL's tower returns
    none) and Qwen3-VL's deep-stack features."""
    parts = [output.pooler_output, output.last_hidden_state]
    parts += pytree.tree_leaves(getattr(output, "deepstack_features", None))
    return [part for part in parts if part is not None]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    stream=st.lists(
        st.lists(st.sampled_from([*ENTRIES, BIG]), min_size=1, max_size=3), min_size=3, max_size=8
    ),
    budgets=st.sampled_from(["auto", (32, 64, LARGEST), None]),
    max_graphs=st.integers(1, 3),
    launches=st.sampled_from([0.0, 2.0, 8.0]),
    static_output=st.booleans(),
    validate=st.booleans(),
)
def test_every_answer_equals_the_towers(
    kind: str,
    stream: list[list[tuple[int, int, int]]],
    budgets: Any,
    max_graphs: int,
    launches: float,
    static_output: bool,
    validate: bool,
) -> None:
    tower = model(kind)
    graphed = wrap_for_stream(
        tower,
        qwen2_vl.Qwen2VLAdapter(budget_step=32, max_tokens=LARGEST),
        budgets,
        launches,
        observe_calls=0,
        max_graphs=max_graphs,
        static_output=static_output,
        validate=validate,
    )
    try:
        for grids in stream:
            pixels, grid = call(entries(kind, grids))
            with torch.inference_mode():
                got = [part.clone() for part in answer(graphed(pixels, grid_thw=grid))]
                with graphed.original():
                    want = answer(tower(pixels, grid_thw=grid))
            assert [t.shape for t in got] == [t.shape for t in want], grids
            for part, expected in zip(got, want):
                assert relative_error(part, expected) <= TOLERANCE, grids
        stats = graphed.stats
        assert stats.graphs <= max_graphs
        assert all(key.batch % 4 == 0 for key in graphed.keys)
        if budgets is not None:
            assert all(key.batch <= LARGEST for key in graphed.keys)
        for reason in stats.eager_calls:
            if "above the largest token budget" in reason:
                assert any(BIG in grids for grids in stream) or budgets is None
    finally:
        graphed.unwrap()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    stream=st.lists(
        st.lists(st.sampled_from(ENTRIES), min_size=1, max_size=3), min_size=9, max_size=14
    ),
)
def test_learnt_budgets_follow_the_traffic_within_eight_graphs(
    kind: str, stream: list[list[tuple[int, int, int]]]
) -> None:
    """Budgets learnt from the calls' token totals (multiples of 4): never more than eight
    graphs (a packed plan's default ``max_graphs``), every answer the tower's, and the budgets
    held pad the totals seen by at most the least any eight budgets under the same top would,
    plus 4 % of their tokens, plus the capture cost of that least plan's budgets
    (:mod:`layergraph.serving.budgets`)."""
    tower = model(kind)
    graphed = layergraph.wrap(
        tower,
        observe_calls=0,
        adapter=qwen2_vl.Qwen2VLAdapter(budget_step=4, max_tokens=256),
        backend=SimulatedGraphs(eager_ms=lambda tokens: 10.0, replay_ms=lambda tokens: 1.0),
    )
    try:
        totals: Counter[int] = Counter()
        for grids in stream:
            pixels, grid = call(entries(kind, grids))
            totals[pixels.shape[0]] += 1
            with torch.inference_mode():
                got = answer(graphed(pixels, grid_thw=grid))
                with graphed.original():
                    want = answer(tower(pixels, grid_thw=grid))
            for part, expected in zip(got, want):
                assert relative_error(part, expected) <= TOLERANCE, grids
            assert graphed.stats.graphs <= PACKED_MAX_GRAPHS
        stats = graphed.stats
        assert stats.eager_total == 0, dict(stats.eager_calls)
        assert len(stats.budgets) <= PACKED_MAX_GRAPHS
        assert {key.batch for key in graphed.keys} <= set(stats.budgets)
        top = stats.budgets[-1]
        candidates = {-(-total // 4) * 4 for total in totals} | {top}
        least, _ = best_budgets(totals, PACKED_MAX_GRAPHS, 4, top, held=candidates)
        tokens = sum(size * count for size, count in totals.items())
        bound = padding(totals, least) + (REPLAN_GAIN + GRAPH_WORTH) * tokens
        assert padding(totals, stats.budgets) <= bound + CAPTURE_COST * sum(least)
    finally:
        graphed.unwrap()
