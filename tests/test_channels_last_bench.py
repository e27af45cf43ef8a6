"""``benchmarks/channels_last.py --tiny``: a timm convnet converted to the channels-last layout
is captured and replayed (graphs simulated on the CPU) with the answers of the model as built.
Float32 throughout; the two layouts run other convolution algorithms, so the errors against a
float32 copy are rounding (1e-4 allowed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("timm")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4


def test_a_channels_last_convnet_replays_with_the_built_models_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import channels_last

    path = tmp_path / "channels-last.json"
    channels_last.main(["--tiny", "--batch-sizes", "1,2", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [(row["model"], row["batch"]) for row in rows] == [("resnet18", 1), ("resnet18", 2)]
    for row in rows:
        assert set(row["waited_ms"]) == {
            "eager",
            "eager_channels_last",
            "layergraph",
            "layergraph_channels_last",
        }
        assert all(error <= TOLERANCE for error in row["errors"].values()), row["errors"]
        assert row["graphs"] == [1, 1] and row["eager_calls"] == [{}, {}]
