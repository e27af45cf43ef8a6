"""``benchmarks/budget_replay.py``: the packed towers' benchmark streams through the runner on the
CPU. On Qwen2.5-VL-7B's and Qwen3-VL-8B's streams (100 requests, given twice) the learnt
budgets are chosen once, after the observed calls, and each is captured once, largest first,
into one pool within 1.1x of the top budget's graph captured alone, every answer equal to the
stand-in's eager one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
OBSERVING = "observing the traffic before choosing token budgets"


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The replay script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("budget_replay")


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen3-vl-8b"])
def test_the_benchmark_stream_captures_each_budget_once_largest_first(
    replay: Any, name: str
) -> None:
    result = replay.main(["--towers", name])[name]
    assert result["calls"] == 200
    assert result["eager_calls"] == {OBSERVING: 32}
    assert result["replans"] == 1
    assert result["captures"] == result["graphs"] == len(result["budgets"]) == 8
    assert result["captured_budgets"] == sorted(result["budgets"], reverse=True)
    assert result["pool_vs_top_alone"] <= 1.1
    assert result["padding_second_pass"] <= 0.18
    assert result["largest_difference"] == 0.0


def test_a_stand_in_call_above_every_budget_is_split_and_equals_eager(replay: Any) -> None:
    runner = replay.runner([64, 128])
    sizes = (100, 60, 20)
    tokens = replay.torch.arange(sum(sizes), dtype=replay.torch.float32).unsqueeze(1)
    with replay.torch.inference_mode():
        got = runner(tokens, sizes=sizes)
        want = runner.plan.region(tokens)
    assert all(replay.torch.equal(g, w) for g, w in zip(got, want))
    assert runner.stats().split_calls == 1


def test_a_failed_capture_ahead_answers_eagerly_and_captures_nothing_after(replay: Any) -> None:
    class HostReading(replay.TokenPlan):
        """Reads a value on the host, which a capture refuses."""

        def region(self, tokens: Any, sizes: tuple[int, ...] = ()) -> Any:
            float(tokens.sum())
            return super().region(tokens, sizes)

    from layergraph.runner import CaptureFailedWarning, GraphRunner, RunnerOptions
    from layergraph.testing import SimulatedGraphs

    backend = SimulatedGraphs(eager_ms=lambda tokens: 10.0, replay_ms=lambda tokens: 1.0)
    runner = GraphRunner(HostReading(), RunnerOptions(observe_calls=2), backend)
    torch = replay.torch
    with torch.inference_mode(), pytest.warns(CaptureFailedWarning) as warned:
        for index, sizes in enumerate([(256,), (1024, 256), (512,), (64,)]):
            tokens = torch.randn(sum(sizes), 1)
            got = runner(tokens, sizes=sizes)
            want = runner.plan.region(tokens)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), index
    stats = runner.stats()
    assert stats.graphs == 0 and backend.captures == 0
    assert stats.failed_captures == len(runner.plan.allocated) == len(warned) >= 1
    assert all(issubclass(w.category, CaptureFailedWarning) for w in warned)
