"""A packed call's metadata goes to the device in one transfer from a staging buffer.

On the CPU through simulated graphs: each call a graph serves writes the budget's staging
buffer once and sends it once, the graph reads the boundaries, positions, windows and position
table rows of the call at hand (calls of equal token totals and other images, one after the
other, through both host buffers in turn), and every answer equals the tower's within 1e-4.
On a GPU: a replayed call with ``grid_thw`` on the host runs with PyTorch's synchronisation
checks set to error, and the staging host buffers are pinned.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import layergraph
from layergraph.staging import Staging
from layergraph.testing import SimulatedGraphs

pytest.importorskip("transformers")
from test_qwen2_vl_adapter import call, check
from test_qwen2_vl_streams import model

EQUAL_TOTALS = ([(1, 4, 6), (2, 2, 2), (1, 8, 8)], [(1, 8, 8), (1, 6, 4), (2, 2, 2)])
"""Two calls of 96 tokens each, with other frames, windows and positions."""


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened to staging buffers, in order: ``"host"`` (views taken to write a call)
    and ``"send"`` (the transfer)."""
    events: list[str] = []
    host, send = Staging.host, Staging.send

    def counted_host(staging: Staging) -> dict[str, torch.Tensor]:
        events.append("host")
        return host(staging)

    def counted_send(staging: Staging) -> None:
        events.append("send")
        send(staging)

    monkeypatch.setattr(Staging, "host", counted_host)
    monkeypatch.setattr(Staging, "send", counted_send)
    return events


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_each_call_writes_and_sends_its_metadata_once_and_never_reads_a_stale_one(
    kind: str, staged: list[str]
) -> None:
    tower = model(kind)
    graphed = layergraph.wrap(
        tower, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[128]
    )
    try:
        for grids in EQUAL_TOTALS * 3:
            check(graphed, tower, grids)
        stats = graphed.stats
        assert stats.graphs == 1 and stats.replays == 6 and stats.eager_total == 0
        # The capture writes the first call's metadata, which its replay then finds in place.
        assert staged == ["host", "send"] * (stats.captures + stats.replays - 1)
    finally:
        graphed.unwrap()


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_call_of_the_grids_the_buffers_hold_sends_no_metadata_and_computes_none(
    kind: str, staged: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tower = model(kind)
    graphed = layergraph.wrap(
        tower, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[128]
    )
    plan = graphed.plan
    computed: list[Any] = []
    compute = plan._compute_host_call
    monkeypatch.setattr(
        plan, "_compute_host_call", lambda grid: computed.append(1) or compute(grid)
    )
    first, second = EQUAL_TOTALS
    try:
        for grids in (first, first, first, second, second, first, second):
            check(graphed, tower, grids)  # new random pixels each call
        assert graphed.stats.replays == 7 and graphed.stats.eager_total == 0
        # Metadata is written for the capture and at each change of grids: first, second,
        # first, second; each grid entry's metadata is computed once.
        assert staged == ["host", "send"] * 4
        assert len(computed) == len(set(first) | set(second))
    finally:
        graphed.unwrap()


def test_fields_are_laid_out_apart_and_reach_the_device_views_through_both_host_buffers() -> None:
    staging = Staging(
        {"a": (torch.long, (3, 2)), "b": (torch.int32, (5,)), "c": (torch.float32, (2, 4))},
        torch.device("cpu"),
    )
    for value in (1, 2, 3):
        fields = staging.host()
        fields["a"].fill_(value)
        fields["b"].copy_(torch.arange(5) * value)
        fields["c"].fill_(value / 2)
        staging.send()
        assert staging.device["a"].eq(value).all()
        assert staging.device["b"].tolist() == [i * value for i in range(5)]
        assert staging.device["c"].eq(value / 2).all()
    assert staging.sends == 3
    pointers = sorted(view.data_ptr() for view in staging.device.values())
    assert all(pointer % 16 == 0 for pointer in pointers)


@pytest.mark.cuda
def test_a_replayed_call_with_its_grid_on_the_host_does_not_synchronise() -> None:
    tower = model("qwen2_5_vl").cuda()
    graphed = layergraph.wrap(
        tower, observe_calls=0, adapter="qwen2_vl", batch_sizes=[128], attention="auto"
    )
    try:
        for grids in EQUAL_TOTALS:  # the first captures (and synchronises)
            pixels = torch.randn(96, 3 * 2 * 14 * 14, device="cuda")
            with torch.inference_mode():
                graphed(pixels, grid_thw=torch.tensor(grids))
        entry: Any = graphed.graphs[0]
        assert all(host.is_pinned() for host in entry.buffers.staged.staging._hosts)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                graphed(pixels, grid_thw=torch.tensor(EQUAL_TOTALS[0]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert graphed.stats.replays >= 2
    finally:
        graphed.unwrap()
        tower.cpu()


def test_the_pixels_past_a_call_are_zeros_after_a_larger_call_and_written_once() -> None:
    """A call writes its pixels and zeros only the rows a larger call before it left, so the
    padding the graph reads is zeros whatever came before."""
    tower = model("qwen2_5_vl")
    graphed = layergraph.wrap(
        tower, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[128]
    )
    try:
        for grids in ([(1, 8, 8), (1, 6, 4)], [(1, 4, 6)], [(1, 2, 2)], [(1, 8, 12)]):
            check(graphed, tower, grids)  # new random pixels each call
            (info,) = graphed.graphs
            tokens = sum(t * h * w for t, h, w in grids)
            pixels = info.buffers.pixels
            assert pixels[:tokens].abs().sum() > 0 and not pixels[tokens:].any(), grids
        assert graphed.stats.replays == 4 and graphed.stats.eager_total == 0
    finally:
        graphed.unwrap()


def test_token_budgets_are_captured_ahead_from_an_example_and_then_only_replayed() -> None:
    """``graphed.capture`` on a packed tower: each budget captured from the example's images
    that fit it, largest first; later calls of those budgets replay without capturing."""
    tower = model("qwen2_5_vl")
    graphed = layergraph.wrap(
        tower, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[32, 128]
    )
    try:
        pixels, grid = call([(1, 8, 8), (1, 4, 6)])  # 88 tokens, the first image 64
        with torch.inference_mode():
            keys = graphed.capture(pixels, grid_thw=grid, progress=False)
            assert [key.batch for key in keys] == [128]  # its first image does not fit 32
            first, second = call([(1, 4, 6), (1, 8, 8)])
            keys = graphed.capture(first, grid_thw=second, progress=False)
        assert [key.batch for key in keys] == [128, 32]  # its first image (24 tokens) fits 32
        before = graphed.stats
        for grids in ([(1, 4, 6)], [(1, 8, 8), (1, 2, 2)], [(1, 2, 4)]):
            check(graphed, tower, grids)
        stats = graphed.stats
        assert stats.captures == before.captures == 2 and stats.eager_total == 0
        assert stats.replays == before.replays + 3
        with pytest.raises(ValueError, match="not multiples of 4"), torch.inference_mode():
            graphed.capture(pixels, grid_thw=grid, batch_sizes=[30], progress=False)
    finally:
        graphed.unwrap()
