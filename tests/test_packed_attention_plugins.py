"""A plugin's attention backend and metadata serving a packed tower (Qwen2.5-VL's).

The plugin registers a backend that reads boundaries when it runs (masked SDPA that records
what it is handed) and builds its metadata through the ``attention_metadata`` hook, which a
packed plan asks with a :class:`~layergraph.attention.PackedLayout` per token budget and kind
of attention (full, windowed). On the CPU through simulated graphs, whose replays run the
captured region again, so the backend sees the metadata a replay reads: it must be the hook's
own tensors, holding each call's boundaries, and every answer must equal the tower's (1e-4).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from packed_helpers import RecordingPlugin

import layergraph
from layergraph.attention import (
    PackedLayout,
    SdpaMaskedAttention,
    SequenceLayout,
    build_metadata,
)
from layergraph.testing import SimulatedGraphs

pytest.importorskip("transformers")
from test_qwen2_vl_adapter import check, tower

BUDGET = 128


def boundaries(grids: list[tuple[int, int, int]], slots: int) -> list[int]:
    """Each frame's first token and the call's end, then the end again for the empty slots."""
    offsets = [0]
    for t, h, w in grids:
        offsets += [offsets[-1] + h * w * (frame + 1) for frame in range(t)]
    return offsets + [offsets[-1]] * (slots + 1 - len(offsets))


def test_a_plugin_backend_reads_the_boundaries_its_hook_built_written_at_each_call(
    layergraph_registry: Any,
) -> None:
    plugin = RecordingPlugin()
    layergraph_registry.add_plugin(plugin, "recording-plugin")
    model = tower()
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        adapter="qwen2_vl",
        attention="recording",
        backend=SimulatedGraphs(),
        batch_sizes=[BUDGET],
    )
    windows = graphed.plan.window_slots(BUDGET, 8)
    calls = ([(1, 4, 6), (2, 2, 2), (1, 8, 8)], [(1, 8, 8), (1, 6, 4), (2, 2, 2)])  # 96 each
    for grids in calls:
        plugin.backend.scrub()
        check(graphed, model, grids)
        full = [cu.tolist() for metadata, cu in plugin.backend.seen if metadata is plugin.built[0]]
        assert full and all(cu == boundaries(grids, slots=8) for cu in full)
        assert all(
            any(metadata is built for built in plugin.built) for metadata, _ in plugin.backend.seen
        )
    assert plugin.asked == [PackedLayout(BUDGET, 8, BUDGET), PackedLayout(BUDGET, windows, 16)]
    assert graphed.stats.graphs == 1 and graphed.stats.replays == 2


def test_packed_metadata_that_cannot_hold_a_budgets_calls_is_refused_naming_the_hook(
    layergraph_registry: Any,
) -> None:
    layergraph_registry.add_plugin(RecordingPlugin(build=lambda layout: 16), "short-plugin")
    graphed = layergraph.wrap(
        tower(),
        observe_calls=0,
        adapter="qwen2_vl",
        attention="recording",
        backend=SimulatedGraphs(),
    )
    pixels, grid = torch.randn(64, 3 * 2 * 14 * 14), torch.tensor([[1, 8, 8]])
    with torch.inference_mode(), pytest.raises(ValueError) as refusal:
        graphed(pixels, grid_thw=grid)
    assert "attention metadata from an attention_metadata hook cannot hold calls of up to" in str(
        refusal.value
    )
    # The first capture is the top budget: 64 tokens with a quarter more room, in 16-token steps.
    assert "max_seqlen must be an int of at least 80" in str(refusal.value)


def test_metadata_holds_a_sequence_layouts_boundaries_and_room_for_a_packed_layouts() -> None:
    layout = SequenceLayout((3, 5))
    metadata = build_metadata(layout, torch.device("cpu"), cu_seqlens=True, seq_lens=True)
    assert metadata.cu_seqlens.tolist() == [0, 3, 8] and metadata.seq_lens.tolist() == [3, 5]
    packed = build_metadata(
        PackedLayout(8, 2, 5), torch.device("cpu"), cu_seqlens=True, seq_lens=True
    )
    assert packed.cu_seqlens.tolist() == [0, 0, 0] and packed.seq_lens.tolist() == [0, 0]
    assert packed.max_seqlen == 5
    with pytest.raises(ValueError, match="max_length at most tokens"):
        PackedLayout(4, 1, 16)


class Named(SdpaMaskedAttention):
    """Masked SDPA under another name: a stand-in for a kernel that reads boundaries."""

    def __init__(self, name: str) -> None:
        self.name = name


class Kernels:
    """Registers two stand-in kernels: ``long`` (fast on sequences longer than a window) and
    ``short`` (fast on windows)."""

    @layergraph.hookimpl
    def register_attention_backends(self, register: Callable[..., None]) -> None:
        register(Named("long"))
        register(Named("short"))


def test_auto_times_each_kind_of_attention_on_the_calls_own_frames_and_windows(
    layergraph_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.vision_utils import get_vision_window_index

    from layergraph_adapters.kit import packed_tower

    timed: list[tuple[str, PackedLayout, tuple[int, ...]]] = []

    def timer(backend: Any, layout: PackedLayout, lengths: tuple[int, ...]) -> float:
        timed.append((backend.name, layout, lengths))
        if backend.name == "long":
            return 1.0 if max(lengths) > 16 else 3.0
        return 2.0 if backend.name == "short" else 5.0  # the masked SDPA, triton: slowest

    monkeypatch.setattr(packed_tower, "packed_timer", lambda *args: timer)
    layergraph_registry.add_plugin(Kernels(), "kernels")
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[BUDGET]
    )
    grids = [(1, 4, 6), (2, 2, 2), (1, 8, 8)]
    check(graphed, model, grids)
    _, windows = get_vision_window_index(torch.tensor(grids), 2, 56, 14)
    window_lengths = tuple(n for n in windows.diff().tolist() if n > 0)
    assert {(layout, lengths) for _, layout, lengths in timed} == {
        (PackedLayout(BUDGET, 8, BUDGET), (24, 4, 4, 64)),
        (PackedLayout(BUDGET, graphed.plan.window_slots(BUDGET, 8), 16), window_lengths),
    }
    assert {"sdpa_varlen", "long", "short"} <= {name for name, _, _ in timed}
    assert graphed.plan.attention_by_budget == {BUDGET: "full: long, windows: short"}


def test_a_warm_start_takes_each_rooms_choice_without_timing_again(
    layergraph_registry: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The backends chosen by timing are saved in the warm-start file; the replica's rooms take
    them untimed. A choice naming a backend no longer offered is timed afresh."""
    from layergraph_adapters.kit import packed_tower

    timed: list[str] = []

    def timer(backend: Any, layout: PackedLayout, lengths: tuple[int, ...]) -> float:
        timed.append(backend.name)
        return {"long": 1.0, "short": 2.0}.get(backend.name, 5.0)

    monkeypatch.setattr(packed_tower, "packed_timer", lambda *args: timer)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    layergraph_registry.add_plugin(Kernels(), "kernels")
    model = tower()
    grids = [(1, 4, 6), (2, 2, 2), (1, 8, 8)]

    def wrapped(**options: Any) -> Any:
        return layergraph.wrap(
            model,
            observe_calls=0,
            adapter="qwen2_vl",
            backend=SimulatedGraphs(),
            batch_sizes=[BUDGET],
            **options,
        )

    first = wrapped()
    check(first, model, grids)
    assert {"long", "short", "sdpa_varlen"} <= set(timed)
    chosen_first = dict(first.plan.attention_by_budget)
    path = tmp_path / "choices.lgws"
    first.save_warm_start(path)
    first.unwrap()

    timed.clear()
    replica = wrapped(warm_start=path)
    check(replica, model, grids)
    assert timed == [] and replica.plan.attention_by_budget == chosen_first
    replica.unwrap()

    stale = wrapped()
    stale.plan.take_measured_choices({(BUDGET, 8, BUDGET): "gone"})
    check(stale, model, grids)
    assert "long" in timed and stale.plan.attention_by_budget == chosen_first


def chosen(name: str, candidates: tuple[Any, ...], timer: Any) -> str:
    """The name of the backend :func:`choose_packed_backend` takes among ``candidates`` for
    two sequences (24 and 40 tokens) in a 64-token room of 8 slots, CPU, float32."""
    from layergraph.attention import choose_packed_backend

    return choose_packed_backend(
        name,
        torch.device("cpu"),
        torch.float32,
        16,
        PackedLayout(64, 8, 64),
        (24, 40),
        backends=candidates,
        timer=timer,
    ).name


def test_a_named_packed_backend_must_read_boundaries_and_auto_keeps_the_fastest() -> None:
    from layergraph.attention import SdpaAttention

    candidates = (SdpaAttention(), SdpaMaskedAttention(), Named("varlen"))
    costs = {"sdpa_varlen": 9.0, "varlen": 1.0}
    assert chosen("auto", candidates, lambda backend, *_: costs[backend.name]) == "varlen"
    assert chosen("auto", candidates, None) == "sdpa_varlen"  # nothing timed: the first
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        chosen("sdpa", candidates, None)  # dense SDPA cannot serve every packing of a budget


def test_a_backend_that_fails_while_timed_is_passed_over_with_a_warning() -> None:
    """A kernel that raises on a room (a library refusing the shape, say) leaves the choice to
    the others; when every one fails, the error says so."""
    from layergraph.attention import AttentionBackendFailed

    candidates = (SdpaMaskedAttention(), Named("broken"), Named("fine"))

    def timer(backend: Any, *_: Any) -> float:
        if backend.name != "fine":
            raise RuntimeError(f"{backend.name} refuses this room")
        return 1.0

    with pytest.warns(AttentionBackendFailed, match="'broken' failed on a room of 64 tokens"):
        assert chosen("auto", candidates, timer) == "fine"

    def failing(backend: Any, *_: Any) -> float:
        raise RuntimeError("no")

    with pytest.warns(AttentionBackendFailed), pytest.raises(RuntimeError, match="every attent"):
        chosen("auto", candidates, failing)
