"""Write docs/coverage.md: which transformers vision towers and VLMs layergraph serves.

    python3 benchmarks/coverage_page.py                 # docs/coverage.md
    python3 benchmarks/coverage_page.py --results r.json --output -

The served and unserved classes come from the coverage test's table
(``tests/coverage_table.py``),
walked in the installed transformers; the batch-1 latencies from the newest H200 run of
``benchmarks/families.py`` in ``docs/results`` (``--results`` names another), and the packed
adapters' from the packed benchmarks' runs listed in :data:`PACKED_RUNS`. The test suite
checks that the committed page is what this script writes, for the transformers it was
written with.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from coverage_table import (  # noqa: E402
    AUDIO_SERVED,
    NOTES,
    PACKED_SERVED,
    SERVED,
    SEVERAL_KINDS,
    TOWERS_IN_PLACE,
    UNSERVED,
    family_of,
    walked_classes,
)

PACKED_BENCHMARKS = {
    "pixtral": "packed_towers.py",
    "qwen2_vl": "packed_towers.py",
    "siglip2": "siglip2_naflex.py",
}
"""The benchmark that measures each packed adapter's towers, in ``benchmarks``."""
PAGE = ROOT / "docs" / "coverage.md"
RESULTS = ROOT / "docs" / "results"
TIMM_SWEEP = RESULTS / "timm-sweep.json"
PACKED_RUNS = (
    "2026-12-01-h200-packed-towers.json",
    "2026-12-01-h200-packed-towers-fused-norm.json",
    "2026-12-01-h200-siglip2-naflex.json",
    "2026-12-01-h200-lfm2-vl-1.6b-naflex.json",
    "2026-12-01-h200-packed-towers-steady.json",
    "2026-12-01-h200-lfm2-vl-1.6b-hand-graph.json",
    "2026-12-01-h200-pixtral-feature-layers.json",
    "2026-12-02-h200-packed-towers-glm-4.1v.json",
    "2026-12-02-h200-lfm2-vl-1.6b-dense-mask.json",
    "2026-12-02-h200-siglip2-so400m-dense-mask.json",
    "2026-12-03-h200-packed-towers.json",
    "2026-12-03-h200-packed-towers-qwen2.5-vl-ab-3-new.json",
    "2026-12-03-h200-siglip2-so400m-in-turns.json",
    "2026-12-03-h200-lfm2-vl-1.6b-in-turns.json",
)
"""H200 runs of the packed benchmarks in ``docs/results``, oldest first: each tower's ratios
come from the newest run that measured it."""
PACKED_TOWERS = {
    "qwen2.5-vl-7b": "qwen2_vl",
    "qwen3-vl-8b": "qwen2_vl",
    "qwen3.5": "qwen2_vl",
    "glm-4.1v-9b": "qwen2_vl",
    "pixtral-12b": "pixtral",
    "siglip2-so400m": "siglip2",
    "lfm2-vl-450m": "siglip2",
    "lfm2-vl-1.6b": "siglip2",
}
"""The packed benchmarks' towers, by the adapter that serves them."""
PACKED_SIZE = "448x448"
"""The image size of ``packed_towers.py``'s per-image table the page reports."""


def _timm_section() -> list[str]:
    """The timm sweep's last run (``tests/timm_sweep.py``): each family's smallest model and
    whether the graphs serve it."""
    if not TIMM_SWEEP.is_file():
        return []
    run = json.loads(TIMM_SWEEP.read_text())
    families = run["families"]
    served = sum(result["status"] == "served" for result in families.values())
    lines = [
        "",
        "## timm families",
        "",
        f"The smallest model of each of timm {run['timm']}'s {len(families)} modeling modules, "
        "built with random weights at its default input size and wrapped by "
        '`adapter="auto"`, checked against eager at batch 1 and 2 on the faithful replay '
        f"(`tests/timm_sweep.py`, the slow test `tests/test_timm_sweep.py`; a default input "
        f"above 384x384 pixels at 224x224): {served} served from graphs, equal to eager.",
        "",
        "| family (module) | model | result | note |",
        "| --- | --- | --- | --- |",
    ]
    for module, result in sorted(families.items()):
        lines.append(
            f"| `{module}` | `{result['model']}` | {result['status']} | {result['reason']} |"
        )
    return lines


def latest_results() -> Path | None:
    """The newest ``*-families.json`` in ``docs/results``, or ``None``."""
    found = sorted(RESULTS.glob("*-families.json"))
    return found[-1] if found else None


def render(results: dict[str, Any] | None) -> str:
    """The page, for the installed transformers and an H200 run's ``results`` (or none)."""
    import transformers

    walked = walked_classes()
    served = sorted(name for name, tiny in SERVED.items() if tiny.available())
    by_adapter: dict[str, list[str]] = defaultdict(list)
    for name in served:
        by_adapter[SERVED[name].adapter].append(name)
    packed: dict[str, list[str]] = defaultdict(list)
    for name in sorted(PACKED_SERVED):
        packed[PACKED_SERVED[name]].append(name)
    served += [name for names in packed.values() for name in names]
    served += sorted(TOWERS_IN_PLACE)
    runs = _runs_by_adapter(results)
    lines = [
        "# Coverage",
        "",
        "Which of transformers' vision towers and VLMs layergraph serves with "
        '`adapter="auto"`, and why not the others. Written by `benchmarks/coverage_page.py` '
        f"for transformers {transformers.__version__} from the coverage test's table "
        "(`tests/coverage_table.py`): the test walks every class of transformers' auto "
        "mappings for image-text-to-text models, image models and zero-shot image "
        "classifiers, builds each "
        "served class tiny and checks that `wrap` recognises it and answers as the unwrapped "
        "model does, and checks that no unserved class is recognised. A class a new "
        "transformers release adds fails the test by name until it is served or listed here.",
        "",
        f"Walked: {len(walked)} classes; served: {sum(n in walked for n in served)} of them "
        f"and {sum(n not in walked for n in served)} models outside the mappings.",
        "",
        "## Served",
        "",
        _source(results),
        "",
        "| family | adapter | graphed | classes | batch 1: eager / layergraph | "
        "layergraph / hand-written graph |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    listed: list[str] = []
    for adapter in sorted(by_adapter, key=lambda a: family_of(a).lower()):
        names = by_adapter[adapter]
        speed, against_hand = runs.get(adapter, ("not measured yet", "not measured yet"))
        lines.append(
            f"| {family_of(adapter)} | `{adapter}` | the whole tower, in place | {len(names)} | "
            f"{speed} | {against_hand} |"
        )
        notes = [f"{name}: {NOTES[name]}" for name in names if name in NOTES]
        listed.append(_classes_item(adapter, names, notes))
    packed_runs = _packed_runs_by_adapter()
    for adapter in sorted(packed):
        script = f"not measured yet (`benchmarks/{PACKED_BENCHMARKS[adapter]}`)"
        speed, against_hand = packed_runs.get(adapter, (script, script))
        lines.append(
            f"| {family_of(adapter)} | `{adapter}` | packed: a call's images in one sequence, a "
            f"graph per token budget | {len(packed[adapter])} | {speed} | {against_hand} |"
        )
        listed.append(_classes_item(adapter, packed[adapter], []))
    lines += ["", "### Classes served, by family", "", *listed]
    lines += [
        "",
        "### Towers served in place",
        "",
        "Models no adapter recognises that hold towers adapters serve, one or several: each "
        "tower is served in place by its own adapter's plan under one wrapper "
        "(`layergraph.multi_tower`), the graphs in one pool, each tower's stats of its own.",
        "",
    ]
    for name, towers in sorted(TOWERS_IN_PLACE.items()):
        parts = ", ".join(f"`{path}` (`{adapter}`)" for path, adapter in towers.items())
        lines.append(f"- `{name}`: {parts}.")
    lines += [
        "",
        "Models holding towers that different adapters serve get the same wrapper, though an "
        "adapter recognises the model:",
        "",
    ]
    for name, towers in sorted(SEVERAL_KINDS.items()):
        parts = ", ".join(f"`{attribute}` (`{adapter}`)" for attribute, adapter in towers.items())
        lines.append(f"- `{name}`: {parts}.")
    lines += [
        "",
        "## Audio encoders",
        "",
        "Outside the walked mappings; each class, and its encoder alone (`WhisperEncoder`, "
        "`Qwen2AudioEncoder`, `Wav2Vec2Model`...; the Omni thinkers' `Qwen2_5OmniAudioEncoder` "
        "and `Qwen3OmniMoeAudioEncoder` by `omni_audio`, per token budget), is recognised by "
        "its adapter, and tests/test_audio_encoders.py, tests/test_waveform_encoders.py and "
        "tests/test_omni_audio.py check their answers.",
        "",
    ]
    by_audio: dict[str, list[str]] = defaultdict(list)
    for name, adapter in sorted(AUDIO_SERVED.items()):
        by_audio[adapter].append(name)
    for adapter, names in by_audio.items():
        lines.append(_classes_item(adapter, names, []))
    lines += _timm_section()
    lines += ["", "## Not served", ""]
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name in sorted(UNSERVED):
        if name in walked:
            by_reason[UNSERVED[name]].append(name)
    for reason, names in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        classes = ", ".join(f"`{name}`" for name in names)
        lines.append(f"- {reason} ({len(names)}): {classes}")
    return "\n".join(lines) + "\n"


def _classes_item(adapter: str, names: list[str], notes: list[str]) -> str:
    """One family's classes as a list item, with the notes about them."""
    classes = ", ".join(f"`{name}`" for name in names)
    noted = "".join(f" {note}." for note in notes)
    return f"- **{family_of(adapter)}** (`{adapter}`): {classes}.{noted}"


def _source(results: dict[str, Any] | None) -> str:
    if results is None:
        return (
            "Latencies: not measured yet; `benchmarks/families.py` on an H200 measures each "
            "family's usual configuration."
        )
    return (
        f"Latencies: `benchmarks/families.py` on {results['device']} (torch "
        f"{results['torch']}, transformers {results['transformers']}), bf16, random weights, "
        "one image at the family's usual size, medians of calls each waited for, for each "
        "configuration measured. Packed adapters: the newest H200 run of "
        "`benchmarks/packed_towers.py` (one image of 448x448 per call; the hand-written graph "
        "is captured for that exact shape) or `benchmarks/siglip2_naflex.py` (one image of "
        "its largest patch count), among "
        + ", ".join(f"[{name}](results/{name})" for name in PACKED_RUNS)
        + "."
    )


def _runs_by_adapter(results: dict[str, Any] | None) -> dict[str, tuple[str, str]]:
    """Per adapter: eager / layergraph and layergraph / hand-written for each configuration
    the H200 run measured, or what it says of those it could not."""
    speeds: dict[str, list[str]] = defaultdict(list)
    against_hand: dict[str, list[str]] = defaultdict(list)
    for row in (results or {}).get("rows", []):
        adapter, model = row["adapter"], row["model"]
        if row["status"] != "measured":
            speeds[adapter].append(f"{model}: {row['status']}")
            continue
        speeds[adapter].append(f"{row['eager_ms'] / row['layergraph_ms']:.2f}x ({model})")
        against_hand[adapter].append(
            f"{row['layergraph_ms'] / row['hand_written_ms']:.3f} ({model})"
        )
    return {
        adapter: ("; ".join(speeds[adapter]), "; ".join(against_hand[adapter]) or "-")
        for adapter in speeds
    }


def _packed_runs_by_adapter() -> dict[str, tuple[str, str]]:
    """Per packed adapter: eager / layergraph and layergraph / hand-written graph of one image
    for each tower the packed benchmarks' runs (:data:`PACKED_RUNS`) measured."""
    rows: dict[str, tuple[float, float | None, str]] = {}
    for name in PACKED_RUNS:
        run = json.loads((RESULTS / name).read_text())
        for tower in run.get("towers", []):
            row = next(r for r in tower["images"] if r["size"] == PACKED_SIZE)
            rows[tower["tower"]] = (
                row["eager_ms"] / row["layergraph_ms"],
                row["layergraph_ms"] / row["hand_graph_ms"],
                f"one {PACKED_SIZE} image",
            )
        if "calls" in run:
            row = next(r for r in run["calls"] if r["images"] == 1)
            hand = row.get("hand_graph_ms")
            paired = row.get("layergraph_vs_hand")  # timed in turns with the hand graph
            rows[run.get("tower", "siglip2-so400m")] = (
                row["eager_ms"] / row["layergraph_ms"],
                paired or (None if hand is None else row["layergraph_ms"] / hand),
                f"one image of {row['max_patches']} patches",
            )
    speeds: dict[str, list[str]] = defaultdict(list)
    against_hand: dict[str, list[str]] = defaultdict(list)
    for tower, (speed, hand, what) in rows.items():
        adapter = PACKED_TOWERS[tower]
        speeds[adapter].append(f"{speed:.2f}x ({tower}, {what})")
        if hand is None:
            against_hand[adapter].append(f"- ({tower}: its hand-written graph failed to capture)")
        else:
            against_hand[adapter].append(f"{hand:.3f} ({tower})")
    return {
        adapter: ("; ".join(speeds[adapter]), "; ".join(against_hand[adapter]))
        for adapter in speeds
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None, help="a families.py JSON file")
    parser.add_argument("--output", default=str(PAGE), help="the page to write, or - to print")
    options = parser.parse_args()
    path = options.results or latest_results()
    results = json.loads(path.read_text()) if path is not None else None
    page = render(results)
    if options.output == "-":
        print(page, end="")
    else:
        Path(options.output).write_text(page)


if __name__ == "__main__":
    main()
