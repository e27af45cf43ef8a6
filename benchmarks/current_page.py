"""docs/benchmarks.md, the current figures, written from the JSON of the runs it names.

    python3 benchmarks/current_page.py            # writes docs/benchmarks.md
    python3 benchmarks/current_page.py --check    # exits 1 if the page differs from its JSON

The page holds the newest run of each family of towers (:data:`RUNS`): waited latency of
eager, the hand-written graph and layergraph by batch size or image size, and the packed
towers' plots. Every run, with its machine, versions and command, is in
docs/benchmark-runs.md; a new run replaces an entry of :data:`RUNS` and the page is written
again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Run:
    """One JSON of ``benchmarks/regression.py`` records (its ``after`` tree), of
    ``layergraph bench`` runs by name (``runs``, as the device scripts gather them), or of
    ``benchmarks/naflex_mixed.py``, and what it is."""

    path: str
    """Under docs/results."""
    title: str
    machine: str
    command: str
    commit: str | None = None
    """The tree the runs timed, for a JSON of ``runs`` or of ``naflex_mixed.py`` (a regression
    JSON names its own)."""
    names: Mapping[str, str] = field(default_factory=dict)
    """For a JSON of ``runs``: the models shown, in order, by their names on the page; the
    bf16 runs of these models are shown. For a JSON of ``naflex_mixed.py``, its model's name."""


TIMM_NAMES = {
    "resnet50": "ResNet-50",
    "convnext_tiny": "ConvNeXt-T",
    "convnext_base": "ConvNeXt-B",
    "efficientvit_b2": "EfficientViT-B2",
    "maxvit_tiny_tf_224": "MaxViT-T",
    "swin_tiny_patch4_window7_224": "Swin-T",
    "swinv2_small_window8_256": "SwinV2-S",
    "beit_base_patch16_224": "BEiT-B",
    "hiera_small_224": "Hiera-S",
}


RUNS = (
    Run(
        "2026-12-06-h100-house-fixed.json",
        "Fixed-resolution towers",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_house.sh fixed",
    ),
    Run(
        "2026-12-06-h100-house-fixed-rest.json",
        "Fixed-resolution towers, the larger ones",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_house.sh fixed-rest largest",
    ),
    Run(
        "2026-12-06-h100-audio-encoders.json",
        "Audio encoders, 30 s of audio per clip",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_audio.sh audio",
    ),
    Run(
        "2026-12-06-h100-house-packed-448x448.json",
        "Native-resolution towers, one 448x448 image",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_house.sh packed:448x448",
    ),
    Run(
        "2026-12-06-h100-house-packed-896x896.json",
        "Native-resolution towers, one 896x896 image",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_house.sh packed:896x896",
    ),
    Run(
        "2026-12-06-h100-timm.json",
        "timm families",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_timm.sh convnets transformers",
        commit="17a7a6b",
        names=TIMM_NAMES,
    ),
    Run(
        "2026-12-06-h100-timm-rest.json",
        "timm families, the rest",
        "One H100 80GB, 2026-12-06",
        "benchmarks/h200_timm.sh convnets transformers",
        commit="94f46b9",
        names=TIMM_NAMES,
    ),
    Run(
        "2026-12-07-h100-samvit-bf16.json",
        "timm: SAM ViT-B at 1024x1024",
        "One H100 80GB, 2026-12-07",
        "layergraph bench --model timm:samvit_base_patch16 --batch-sizes 1,8 --compile",
        commit="d98ae48",
        names={"samvit_base_patch16": "SAM ViT-B"},
    ),
    Run(
        "2026-12-07-h100-naflex-profile.json",
        "timm: NaFlexVit-B on mixed image sizes (8 calls of 576 patches a row)",
        "One H100 80GB, 2026-12-07",
        "python3 benchmarks/naflex_mixed.py --compile --profile",
        commit="d98ae48",
        names={"naflexvit_base_patch16_gap": "NaFlexVit-B"},
    ),
)

INTRODUCTION = """\
# Benchmarks

The current figures, one table per family of towers, written from the JSON of their runs by
`python3 benchmarks/current_page.py`. Each figure is the median latency in milliseconds of a
call waited for (the host work before each replay counts), in bf16, models built from their
configurations with random weights. "Hand-written graph" is the whole forward captured once
with `torch.cuda.graph` for the exact shape, what a user writes by hand for one shape; "-"
where it was not timed; "(eager)": layergraph measured its graph no faster than an eager call
and served the size eagerly. Speedup is eager's time over layergraph's. Every run, with its
machine, versions, command, the loop's throughput beside the waited latency, and
`torch.compile(mode="reduce-overhead")` where it was timed, is in
[Benchmark runs](benchmark-runs.md).
"""

PLOTS = """\
## The packed towers at a glance

Speedup of layergraph over eager and over the hand-written graph against the tokens of a call,
and the seconds of each tower's stream of 100 requests (one H200, 2026-12-03; see
[the run](benchmark-runs.md#the-packed-towers-at-a-glance)).

![speedup against tokens per call](results/2026-12-03-h200-packed-calls.png)

![the streams](results/2026-12-03-h200-packed-streams.png)
"""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _records(run: Run) -> tuple[str, list[dict[str, Any]]]:
    """The commit of the run's tree and its records: a regression JSON's tree after the
    change (the key ``after (COMMIT)``), or the bf16 runs of :attr:`Run.names` in their
    order, named as there."""
    data = json.loads((ROOT / "docs" / "results" / run.path).read_text())
    if ("runs" in data or "model" in data) and run.commit is None:
        raise ValueError(f"{run.path} names no tree: its Run needs the commit timed")
    if "model" in data:
        return run.commit, [_mixed_sizes_record(run, data)]
    if "runs" in data:
        runs = [entry for entry in data["runs"].values() if entry["dtype"] == "bfloat16"]
        order = list(run.names)
        shown = sorted(
            (entry for entry in runs if entry["model"] in run.names),
            key=lambda entry: order.index(entry["model"]),
        )
        return run.commit, [entry | {"model": run.names[entry["model"]]} for entry in shown]
    (key,) = [key for key in data if key.startswith("after")]
    return key.removeprefix("after (").removesuffix(")"), data[key]


def _mixed_sizes_record(run: Run, data: dict[str, Any]) -> dict[str, Any]:
    """A ``benchmarks/naflex_mixed.py`` JSON (bf16) as one model's record, its waited medians
    in the rows of ``layergraph bench``."""
    if data["dtype"] != "bfloat16":
        raise ValueError(f"{run.path} is a {data['dtype']} run; the page shows bf16")
    rows = [
        {
            "batch": row["batch"],
            "eager_wait_ms": row["eager"]["waited_ms"],
            "plain_graph_wait_ms": row["hand_written"]["waited_ms"],
            "layergraph_wait_ms": row["layergraph"]["waited_ms"],
            "layergraph_served": "graph" if row["graphs"] else "eager",
        }
        for row in data["rows"]
    ]
    return {"model": run.names[data["model"]], "rows": rows}


def section(run: Run) -> str:
    """One run's table: a row per model and batch size it measured (the image size is the
    model's own, or the one the run's title names)."""
    commit, records = _records(run)
    lines = [
        f"## {run.title}",
        "",
        f"{run.machine}, layergraph at `{commit}`; `{run.command}` ([JSON](results/{run.path})).",
        "",
        "| model | batch | eager | hand-written graph | layergraph | speedup |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for record in records:
        for row in record.get("rows", []):
            eager, graphed = row["eager_wait_ms"], row["layergraph_wait_ms"]
            speedup = "-" if not (eager and graphed) else f"{eager / graphed:.2f}x"
            served = " (eager)" if row.get("layergraph_served") == "eager" else ""
            lines.append(
                f"| {record['model']} | {row['batch']} | {_ms(eager)} | "
                f"{_ms(row['plain_graph_wait_ms'])} | {_ms(graphed)}{served} | {speedup} |"
            )
    return "\n".join(lines) + "\n"


def page() -> str:
    """The whole page."""
    return "\n".join([INTRODUCTION, *map(section, RUNS), PLOTS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} differs from its runs' JSON: run benchmarks/current_page.py")
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
