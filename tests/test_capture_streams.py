"""The capture streams' bookkeeping, on the CPU: one stream per live pool, reused once it is gone.

Stream and pool creation are replaced by stand-ins; what runs on the GPU (the anchor capture
and the workspaces it pins) is covered by ``tests/test_cuda_reliability.py``.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator

import pytest

from layergraph import LayergraphDeprecationWarning, capture_streams

DEVICE = 7  # a device number no other test uses


class Pool:
    """Stands in for a graph pool: something a stream can belong to."""

    partner: Pool | None = None


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    counter = itertools.count()
    monkeypatch.setattr(capture_streams, "_new_stream", lambda device: f"stream-{next(counter)}")
    monkeypatch.setattr(capture_streams.torch.cuda, "graph_pool_handle", lambda: (0, next(counter)))
    monkeypatch.setitem(capture_streams._free_streams, DEVICE, [])
    yield


def test_each_live_pool_has_a_capture_stream_of_its_own() -> None:
    first, second = Pool(), Pool()
    streams = (
        capture_streams.take_stream(DEVICE, first),
        capture_streams.take_stream(DEVICE, second),
    )
    assert streams[0] is not streams[1]
    assert streams[0].stream != streams[1].stream
    assert streams[0].anchor_pool != streams[1].anchor_pool
    assert capture_streams.free_streams(DEVICE) == 0


def test_a_collected_pool_gives_its_capture_stream_back_for_reuse() -> None:
    pool = Pool()
    stream = capture_streams.take_stream(DEVICE, pool)
    del pool
    assert capture_streams.free_streams(DEVICE) == 1
    assert capture_streams.take_stream(DEVICE, Pool()) is stream


def test_pools_coming_and_going_never_need_more_capture_streams_than_were_alive_at_once() -> None:
    made = set()
    for _ in range(20):
        pools = [Pool(), Pool()]
        made.update(id(capture_streams.take_stream(DEVICE, pool)) for pool in pools)
        del pools
    assert len(made) == 2 and capture_streams.free_streams(DEVICE) == 2


def test_a_pool_in_a_reference_cycle_is_collected_before_a_new_capture_stream_is_made() -> None:
    gc.disable()
    try:
        first, second = Pool(), Pool()
        first.partner, second.partner = second, first
        stream = capture_streams.take_stream(DEVICE, first)
        del first, second  # garbage, but only a collection frees it
        assert capture_streams.free_streams(DEVICE) == 0
        assert capture_streams.take_stream(DEVICE, Pool()) is stream
    finally:
        gc.enable()


def test_the_old_module_name_gives_the_new_names_with_a_deprecation() -> None:
    import importlib
    import sys

    sys.modules.pop("layergraph.capture_lanes", None)
    with pytest.warns(LayergraphDeprecationWarning, match="layergraph.capture_streams since"):
        old = importlib.import_module("layergraph.capture_lanes")
    assert old.CaptureLane is capture_streams.CaptureStream
    assert old.take_lane is capture_streams.take_stream
