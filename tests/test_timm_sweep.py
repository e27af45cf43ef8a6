"""The timm sweep (``tests/timm_sweep.py``): every family's smallest model, as recorded in
``docs/results/timm-sweep.json`` (which the coverage page lists), still gets the result recorded
for it: served from graphs and equal to eager, or the recorded reason. A family whose model
runs unwrapped never fails wrapped."""

from __future__ import annotations

import json

import pytest
from timm_sweep import RESULTS, sweep_one

timm = pytest.importorskip("timm")
pytestmark = pytest.mark.slow

RUN = json.loads(RESULTS.read_text())


@pytest.mark.parametrize("module", sorted(RUN["families"]))
def test_a_family_gets_the_result_the_coverage_page_lists(module: str) -> None:
    recorded = RUN["families"][module]
    if not timm.is_model(recorded["model"]):
        pytest.skip(f"timm {timm.__version__} has no {recorded['model']}")
    result = sweep_one(recorded["model"])
    assert result["status"] not in {"wrong", "broken"}, result
    if timm.__version__ == RUN["timm"]:
        assert result == recorded, "docs/results/timm-sweep.json is stale: run tests/timm_sweep.py"
