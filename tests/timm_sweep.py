"""The timm sweep: the smallest model of every timm family (modeling module), built with random
weights at its default input size, wrapped by ``adapter="auto"`` and checked against eager on
the faithful replay at two batch sizes.

Each family's result is one of: served (every call replayed, equal to eager), eager (served
eagerly, with the reason the graphs give: an operation a capture refuses), refused at ``wrap``
(with the reason), or not swept (it does not run from its defaults); ``wrong`` (an answer
other than eager's) and ``broken`` (a call that runs unwrapped fails wrapped) are failures. A
family whose default input is larger than a CPU sweep builds is swept at 224x224 pixels. The
slow test runs the sweep; the coverage page lists its last run, kept in
``docs/results/timm-sweep.json``:

    python3 tests/timm_sweep.py                  # writes docs/results/timm-sweep.json
    python3 tests/timm_sweep.py csatv2 qwen3_vit  # those families' results replaced in it
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "timm-sweep.json"
LARGEST_PIXELS = 384 * 384
"""The largest default input the CPU sweep builds a family's model at."""
SMALLER_SIDE = 224
"""The side of the images a family whose default input is larger is swept at (built with
``img_size`` where its model takes one)."""


def smallest_per_family() -> dict[str, str]:
    """The model of fewest parameters of each timm modeling module, by module (counted on the
    meta device: nothing is allocated)."""
    import timm
    from timm.models import _registry

    by_module: dict[str, list[str]] = {}
    for name in timm.list_models():
        by_module.setdefault(_registry._model_to_module[name], []).append(name)
    chosen = {}
    for module, names in sorted(by_module.items()):
        sizes = {}
        for name in names:
            try:
                with torch.device("meta"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = timm.create_model(name, pretrained=False)
            except Exception:  # a model that does not build from its defaults
                continue
            sizes[name] = sum(p.numel() for p in model.parameters())
        if sizes:
            chosen[module] = min(sizes, key=lambda name: (sizes[name], name))
    return chosen


def sweep_one(name: str) -> dict[str, Any]:
    """One model's result: ``status`` (served, eager, refused, not swept) and ``reason``."""
    import timm

    from layergraph import wrap
    from layergraph.testing import SimulatedGraphs
    from layergraph.validation import relative_error

    shape = tuple(timm.models.get_pretrained_cfg_value(name, "input_size") or (3, 224, 224))
    note = ""
    if shape[1] * shape[2] > LARGEST_PIXELS:
        note = f"at {SMALLER_SIDE}x{SMALLER_SIDE} (its default input, {shape[1]}x{shape[2]}, is "
        note += "larger than the CPU sweep builds)"
        shape = (shape[0], SMALLER_SIDE, SMALLER_SIDE)
    torch.manual_seed(0)
    calls = [torch.randn(batch, *shape) for batch in (1, 2)]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = _build(timm, name, shape[1] if note else None)
            expected = [model(x) for x in calls]
        except Exception as error:  # the model itself fails: nothing to serve
            return {"model": name, "status": "not swept", "reason": _first_line(error)}
        try:
            graphed = wrap(model, backend=SimulatedGraphs())
        except Exception as error:
            return {"model": name, "status": "refused", "reason": _first_line(error)}
        try:
            got = [graphed(x) for x in calls]
        except Exception as error:  # runs unwrapped, fails wrapped
            return {"model": name, "status": "broken", "reason": _first_line(error)}
    for mine, theirs in zip(got, expected, strict=True):
        pairs = zip(_tensors(mine), _tensors(theirs), strict=True)
        if any(relative_error(a, b) != 0.0 for a, b in pairs):
            return {"model": name, "status": "wrong", "reason": "differs from eager"}
    stats = graphed.stats
    graphed.unwrap()
    if stats.eager_total:
        reasons = "; ".join(sorted(str(reason) for reason in stats.eager_calls))
        return {"model": name, "status": "eager", "reason": reasons}
    return {"model": name, "status": "served", "reason": note}


def _build(timm: Any, name: str, side: int | None) -> torch.nn.Module:
    """``name`` with random weights, for images of ``side`` pixels where given (passed as
    ``img_size`` to a model that takes one)."""
    if side is not None:
        try:
            return timm.create_model(name, pretrained=False, img_size=side).eval()
        except TypeError:  # a model without img_size: it takes other sizes as they come
            pass
    return timm.create_model(name, pretrained=False).eval()


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _tensors(output: Any) -> list[torch.Tensor]:
    return list(output) if isinstance(output, (list, tuple)) else [output]


def sweep() -> dict[str, Any]:
    """Every family's result, by module, with the timm version swept."""
    import timm

    families = {module: sweep_one(name) for module, name in smallest_per_family().items()}
    return {"timm": timm.__version__, "families": families}


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:  # the families named: their results replaced in the recorded run
        run = json.loads(RESULTS.read_text())
        for module in sys.argv[1:]:
            run["families"][module] = sweep_one(run["families"][module]["model"])
    else:
        run = sweep()
    RESULTS.write_text(json.dumps(run, indent=1) + "\n")
    print(f"wrote {RESULTS}")
