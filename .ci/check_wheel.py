"""CI's check of a built wheel, run with the wheel installed alone in a folder on PYTHONPATH and
from outside the source tree: layergraph and its adapters import from the wheel, at the
version of the source, with every package and the license inside."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import distribution
from pathlib import Path

installed = Path(sys.argv[1]).resolve()
expected = sys.argv[2]

import layergraph  # noqa: E402

assert Path(layergraph.__file__).resolve().is_relative_to(installed), layergraph.__file__
assert layergraph.__version__ == expected, (layergraph.__version__, expected)
for name in (
    "layergraph.serving.engine",
    "layergraph.service",
    "layergraph.attention",
    "layergraph.kernels",
    "layergraph.bench",
    "layergraph_adapters.kit.packed_tower",
    "layergraph_adapters.example_models",
    "layergraph_pytest",
):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(installed), module.__file__
files = [str(path) for path in distribution("layergraph").files or []]
assert any(path.endswith("licenses/LICENSE") for path in files), "no LICENSE in the wheel"
assert any(path.endswith("layergraph/py.typed") for path in files), "no py.typed in the wheel"
print(f"wheel layergraph {layergraph.__version__}: {len(files)} files, imports from {installed}")
