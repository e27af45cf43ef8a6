"""``benchmarks/large_batch.py --tiny``: each column of one batch runs alone without a GPU
(graphs simulated on the CPU), layergraph's answer is eager's (float32, the same kernels:
1e-6 allowed), and a column that runs out of memory is recorded as such while the others
still run (layergraph's with its stats, the model unwrapped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("timm")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-6


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import large_batch

    path = tmp_path / "large.json"
    monkeypatch.setattr(sys, "argv", ["large_batch.py", "--tiny", "--json", str(path)])
    large_batch.main()
    return json.loads(path.read_text())


def test_each_column_runs_alone_and_layergraph_answers_as_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    result = _run(tmp_path, monkeypatch)
    eager, graphed = result["rows"]
    assert (eager["column"], graphed["column"]) == ("eager", "layergraph")
    for row in (eager, graphed):
        assert row["waited_ms"] > 0 and row["loop_ms"] > 0 and row["first_call_s"] > 0
    assert graphed["served"] == ["graph"] and graphed["graphs"] == 1
    assert graphed["eager_reasons"] == {}
    assert graphed["error_vs_eager"] <= TOLERANCE


def test_a_column_out_of_memory_is_recorded_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import large_batch

    prepared = large_batch.prepared

    def eager_out_of_memory(column: str, *args: Any) -> Any:
        if column != "eager":
            return prepared(column, *args)

        def forward(*_: Any, **__: Any) -> Any:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

        return forward, None

    monkeypatch.setattr(large_batch, "prepared", eager_out_of_memory)
    eager, graphed = _run(tmp_path, monkeypatch)["rows"]
    assert eager == {
        "column": "eager",
        "out_of_memory": "CUDA out of memory. Tried to allocate 80.00 GiB",
    }
    assert graphed["served"] == ["graph"] and "error_vs_eager" not in graphed


def test_layergraph_out_of_memory_keeps_its_stats_and_unwraps_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import large_batch

    prepared = large_batch.prepared
    wrappers: list[Any] = []

    def layergraph_out_of_memory(column: str, *args: Any) -> Any:
        fn, graphed = prepared(column, *args)
        if column != "layergraph":
            return fn, graphed
        wrappers.append(graphed)

        def forward(*call_args: Any, **call_kwargs: Any) -> Any:
            fn(*call_args, **call_kwargs)  # served from a graph, then the device "fills"
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return forward, graphed

    monkeypatch.setattr(large_batch, "prepared", layergraph_out_of_memory)
    _, graphed = _run(tmp_path, monkeypatch)["rows"]
    assert graphed["out_of_memory"].startswith("CUDA out of memory")
    assert graphed["served"] == ["graph"] and graphed["graphs"] == 1
    assert wrappers[0].unwrapped
