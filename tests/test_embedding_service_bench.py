"""``benchmarks/embedding_service.py --device cpu``: the service benchmark's machinery (closed-
loop clients, dynamic batching, eager and wrapped encoders taking turns, the JSON record) on
the CPU, where both encoders run eagerly and their embeddings agree exactly."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("open_clip")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("embedding_service")


def test_the_service_is_driven_by_concurrent_clients_and_recorded(
    bench: Any, tmp_path: Path
) -> None:
    path = tmp_path / "service.json"
    argv = ["--device", "cpu", "--models", "ViT-B-32", "--clients", "3", "--seconds", "0.5"]
    argv += ["--rounds", "1", "--max-batch-size", "2", "--sentence-transformers", "--json"]
    assert bench.main([*argv, str(path)]) == 0
    record = json.loads(path.read_text())
    (row,) = record["service"]
    assert row["model"] == "ViT-B-32" and row["clients"] == 3
    assert row["relative_error_vs_eager"] == 0.0
    for method in ("eager", "layergraph"):
        result = row[method]
        assert result["requests"] > 0 and result["images_per_s"] > 0
        assert result["p50_ms"] <= result["p99_ms"]
        sizes = {int(size) for size in result["batch_sizes"]}
        assert sizes <= {1, 2}  # never beyond --max-batch-size
    assert record["settings"]["max_batch_size"] == 2
