"""``benchmarks/naflex_mixed.py --tiny``: timm's NaFlexVit on batches of mixed image sizes runs
every column without a GPU (graphs simulated on the CPU, which refuse what a CUDA capture
refuses), one graph serves every batch of a batch size, and every column's answers agree
with a float32 copy of the model: float32 throughout, so the errors are rounding (1e-5
allowed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("timm")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5


def test_the_tiny_run_serves_mixed_sizes_from_one_graph_per_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import naflex_mixed

    path = tmp_path / "naflex.json"
    argv = ["naflex_mixed.py", "--tiny", "--batch-sizes", "1,3", "--profile", "--json", str(path)]
    monkeypatch.setattr(sys, "argv", argv)
    naflex_mixed.main()
    result = json.loads(path.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert len(set(row["real_patches"])) > 1  # the batches hold images of other sizes
        assert row["graphs"] == 1 and row["eager_calls"] == {}
        assert row["keys"] == [f"(batch={row['batch']}, sequence=naflex: 64 patches a row)"]
        for column in ("eager", "layergraph", "hand_written"):
            assert row[f"{column}_error"] <= TOLERANCE
            assert row[column]["waited_ms"] > 0 and row[column]["loop_ms"] > 0
        for column in ("layergraph", "hand_written"):  # no device: host time, no kernels
            cost = row["profile"][column]
            assert cost["host_ms"] > 0 and cost["device_kernels"] == 0 and cost["top"] == []
            own = [function["own_ms"] for function in cost["host_functions"]]
            assert len(own) == 10 and own == sorted(own, reverse=True) and own[0] > 0
        names = [f["name"] for f in row["profile"]["layergraph"]["host_functions"]]
        assert any(name.startswith("layergraph/") for name in names), names  # its own work
