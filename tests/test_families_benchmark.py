"""benchmarks/families.py: its code path on the CPU (``--tiny``), its example configurations.

On the CPU layergraph runs on simulated graphs and the hand-written graph is left out; the
tiny towers are float32, so layergraph's output equals eager's to 1e-4. The full-size example
configurations are checked on the meta device (no memory): each builds, and its family's
adapter recognises it and makes a plan for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("rich")

from layergraph import PlanContext  # noqa: E402
from layergraph.plugins import get_registry  # noqa: E402
from layergraph_adapters.example_models.towers import TOWER_EXAMPLES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import families  # noqa: E402

CHOSEN = ("vit-base-224", "dinov2-reg-large-224", "idefics3-8b-364", "llama4-scout-336")


def test_tiny_run_measures_each_chosen_configuration(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path; a GPU runs the full-size benchmark")
    out = tmp_path / "families.json"
    section = tmp_path / "section.md"
    argv = ["--tiny", "--models", ",".join(CHOSEN), "--iters", "2", "--json", str(out)]
    assert families.main([*argv, "--markdown", str(section)]) == 0
    record = json.loads(out.read_text())
    assert record["tiny"] and record["dtype"] == "float32"
    rows = {row["model"]: row for row in record["rows"]}
    assert sorted(rows) == sorted(CHOSEN)
    for row in rows.values():
        assert row["status"] == "measured"
        assert row["relative_error"] <= 1e-4 and row["within_tolerance"]
        # Against the float64 copy: float32 rounding, the graph's the same as eager's.
        assert 0 < row["eager_error"] <= 1e-3
        assert row["layergraph_error"] == pytest.approx(row["eager_error"], rel=1e-6)
        assert row["within_eager_error"]
        assert row["served"] == "graph"
        assert row["hand_written_ms"] is None  # needs a GPU
    assert rows["idefics3-8b-364"]["adapter"] == "idefics"
    table = section.read_text().splitlines()
    assert table[0] == "## Tower families at batch 1 (`benchmarks/families.py`)"
    assert sum(line.startswith("| ") for line in table) == 2 + len(CHOSEN)  # header, rule, rows
    assert any(line.startswith("| ViT | vit-base-224 | 32 |") for line in table)


def test_a_family_the_installed_transformers_lacks_gets_a_row_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> type:
        raise AttributeError(name)

    monkeypatch.setattr(families, "transformers_class", missing)
    rows = families.run(tiny=True, models={"vit-base-224"}, iters=1, device=torch.device("cpu"))
    assert [row.status for row in rows] == [f"not in transformers {transformers.__version__}"]
    assert rows[0].eager_ms is None


def test_without_a_gpu_the_full_size_run_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    assert families.main([]) == 1
    assert "--tiny runs the same code path" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "name"),
    [(spec, name) for name, (spec, _) in TOWER_EXAMPLES.items()],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_every_example_configuration_builds_and_gets_a_plan(spec: object, name: str) -> None:
    example = TOWER_EXAMPLES[name][1]
    model = families.build_tower(example.tower, example.settings, torch.bfloat16, "meta")
    adapter = get_registry().create(spec.adapter, {})
    assert adapter.recognizes(model)
    plan = adapter.plan(model, PlanContext(get_registry()))
    assert plan.owner is model and len(plan.layers()) >= 6  # full size: Whisper base has 6


def refused_capture(model: object, **inputs: object) -> object:
    """A hand-written graph as a GPU refuses it."""
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")


def test_a_hand_written_graph_that_fails_is_recorded_and_the_run_goes_on() -> None:
    spec = next(spec for spec in families.SPECS if spec.adapter == "vit")
    cpu = torch.device("cpu")
    row = families.measure(
        spec, "vit-base-224", tiny=True, device=cpu, iters=1, hand_graph=refused_capture
    )
    assert row.hand_written_failure == (
        "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    )
    assert row.hand_written_ms is None and row.against_hand_written is None
    assert row.layergraph_ms is not None and row.within_tolerance  # the row goes on
    record = {"device": "cpu", "torch": "", "transformers": "", "dtype": "float32", "iters": 1}
    record["rows"] = [dict(vars(row), speedup=row.speedup, against_hand_written=None)]
    assert "failed (RuntimeError: CUDA error" in families.markdown(record)


def test_the_idefics_hand_written_graph_captures_what_layergraph_captures() -> None:
    """Idefics' own embeddings index by a boolean mask, which a capture refuses: the hand graph
    is made with layergraph's position ids (same values), which are undone afterwards."""
    spec = next(spec for spec in families.SPECS if spec.adapter == "idefics")
    seen: list[bool] = []

    def replay_as_eager(model: torch.nn.Module, **inputs: object) -> object:
        seen.append("forward" in vars(model.embeddings))
        return lambda **new: model(**new)

    name = next(name for name, (held, _) in TOWER_EXAMPLES.items() if held is spec)
    row = families.measure(
        spec, name, tiny=True, device=torch.device("cpu"), iters=1, hand_graph=replay_as_eager
    )
    assert seen == [True]
    assert row.hand_written_of == "the whole tower, position ids as layergraph computes them"
    assert row.hand_written_failure is None and row.hand_written_error <= 1e-6
