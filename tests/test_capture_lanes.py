"""The capture lanes' bookkeeping, on the CPU: one lane per live pool, reused once it is gone.

Stream and pool creation are replaced by stand-ins; what runs on the GPU (the anchor capture
and the workspaces it pins) is covered by ``tests/test_cuda_reliability.py``.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator

import pytest

from layergraph import capture_lanes

DEVICE = 7  # a device number no other test uses


class Pool:
    """Stands in for a graph pool: something a lane can belong to."""

    partner: Pool | None = None


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    counter = itertools.count()
    monkeypatch.setattr(capture_lanes, "_new_stream", lambda device: f"stream-{next(counter)}")
    monkeypatch.setattr(capture_lanes.torch.cuda, "graph_pool_handle", lambda: (0, next(counter)))
    monkeypatch.setitem(capture_lanes._free_lanes, DEVICE, [])
    yield


def test_each_live_pool_has_a_lane_of_its_own() -> None:
    first, second = Pool(), Pool()
    lanes = capture_lanes.take_lane(DEVICE, first), capture_lanes.take_lane(DEVICE, second)
    assert lanes[0] is not lanes[1]
    assert lanes[0].stream != lanes[1].stream
    assert lanes[0].anchor_pool != lanes[1].anchor_pool
    assert capture_lanes.free_lanes(DEVICE) == 0


def test_a_collected_pool_gives_its_lane_back_for_reuse() -> None:
    pool = Pool()
    lane = capture_lanes.take_lane(DEVICE, pool)
    del pool
    assert capture_lanes.free_lanes(DEVICE) == 1
    assert capture_lanes.take_lane(DEVICE, Pool()) is lane


def test_pools_coming_and_going_never_need_more_lanes_than_were_alive_at_once() -> None:
    made = set()
    for _ in range(20):
        pools = [Pool(), Pool()]
        made.update(id(capture_lanes.take_lane(DEVICE, pool)) for pool in pools)
        del pools
    assert len(made) == 2 and capture_lanes.free_lanes(DEVICE) == 2


def test_a_pool_in_a_reference_cycle_is_collected_before_a_new_lane_is_made() -> None:
    gc.disable()
    try:
        first, second = Pool(), Pool()
        first.partner, second.partner = second, first
        lane = capture_lanes.take_lane(DEVICE, first)
        del first, second  # garbage, but only a collection frees it
        assert capture_lanes.free_lanes(DEVICE) == 0
        assert capture_lanes.take_lane(DEVICE, Pool()) is lane
    finally:
        gc.enable()
