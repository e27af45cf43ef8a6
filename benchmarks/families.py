"""Every tower family's usual configuration at batch 1: eager, layergraph, a hand-written graph.

    python3 benchmarks/families.py --json families.json          # on a GPU: bf16, full size
    python3 benchmarks/families.py --tiny                        # the same code path, tiny, CPU

For each example configuration of each tower family in layergraph's table (SigLIP, CLIP,
InternViT, Idefics2/3, SmolVLM, Janus, AIMv2, DINOv2 with and without registers, ViT, Llama 4,
Mllama), built from its configuration with random weights (nothing is downloaded) and fed one
image (Mllama: one image of four tiles) at the family's usual size, as its VLM feeds it:

- eager: the unmodified tower;
- a hand-written ``torch.cuda.graph`` of the tower's whole forward (``layergraph.reference``),
  with the changes layergraph makes so that a CUDA stream can capture the tower at all and
  nothing else (Idefics' position ids without boolean-mask indexing, the same values): a graph
  of what layergraph captures. A hand-written graph that still fails is recorded in its row
  (``hand_written_failure``) and the run goes on;
- layergraph: ``wrap(tower)`` with the family's adapter, default options, captured ahead.

Latencies are medians of calls each waited for, timed with CUDA events
(:func:`layergraph.timing.waited_ms`); relative errors compare the first output tensor with
eager's, against bf16's tolerance (2e-2), and eager's and layergraph's with a float32 copy's
(float64 on the CPU), where layergraph's may be at most 1.1 times eager's own. A family whose
classes the installed transformers lacks gets a row saying so. ``--tiny`` builds each family
small, in float32, and runs layergraph on simulated graphs when there is no GPU (the
hand-written graph needs one), so that the whole script runs anywhere in seconds. ``--json``
writes the rows, ``--markdown`` the section of ``docs/benchmark-runs.md`` that holds them;
``benchmarks/coverage_page.py`` reads a GPU run's JSON from ``docs/results``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from copy import deepcopy
from dataclasses import asdict, dataclass
from typing import Any

import torch

import layergraph
from layergraph.ledger import Change
from layergraph.reference import plain_graph
from layergraph.testing import SimulatedGraphs
from layergraph.timing import waited_ms
from layergraph.validation import DEFAULT_TOLERANCE, first_tensor, relative_error
from layergraph_adapters.example_models.towers import TOWER_EXAMPLES, capture_changes
from layergraph_adapters.internvl import INTERNVL
from layergraph_adapters.kit.tower_specs import (
    TowerSpec,
    build_tower,
    pair,
    transformers_class,
)
from layergraph_adapters.towers import TOWERS

SPECS: tuple[TowerSpec, ...] = (*TOWERS, INTERNVL)
"""Every family with example configurations."""

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)
"""What ``--tiny`` changes in every example's settings."""

TINY_FIXES: dict[str, dict[str, Any]] = {
    "internvit-300m": dict(image_size=[32, 32], patch_size=[8, 8]),
    "internvit-6b": dict(image_size=[32, 32], patch_size=[8, 8]),
    "llama4-scout-336": dict(
        intermediate_size=256, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64
    ),
    "mllama-11b-560": dict(
        attention_heads=4,
        num_global_layers=1,
        max_num_tiles=2,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        intermediate_layers_indices=[0, 1],
        vision_output_dim=192,
    ),
}
"""Settings that must change along with :data:`SMALL` for a configuration to hold together:
the pixel-shuffle MLP's widths of Llama 4, Mllama's tiles and intermediate layers."""


@dataclass
class Row:
    """One example configuration at batch 1."""

    family: str
    adapter: str
    model: str
    image_size: int | None = None
    status: str = "measured"
    """``"measured"``, or why not (the class missing in this transformers, an error)."""
    eager_ms: float | None = None
    layergraph_ms: float | None = None
    hand_written_ms: float | None = None
    relative_error: float | None = None
    """layergraph's first output tensor against eager's."""
    eager_error: float | None = None
    """Eager's first output tensor against a wider copy's (float32; float64 on the CPU)."""
    layergraph_error: float | None = None
    """layergraph's first output tensor against the wider copy's."""
    hand_written_error: float | None = None
    hand_written_of: str | None = None
    """What the hand-written graph captured: the whole tower, with any change a capture needs."""
    hand_written_failure: str | None = None
    """Why the hand-written graph could not be made or run, if it could not."""
    within_tolerance: bool | None = None
    within_eager_error: bool | None = None
    """Whether :attr:`layergraph_error` is at most :data:`ERROR_MARGIN` times eager's own."""
    served: str | None = None
    """How layergraph served the batch (``graph``, or ``eager`` with the reason)."""

    @property
    def speedup(self) -> float | None:
        """Eager's latency over layergraph's."""
        if self.eager_ms is None or self.layergraph_ms is None:
            return None
        return self.eager_ms / self.layergraph_ms

    @property
    def against_hand_written(self) -> float | None:
        """layergraph's latency over the hand-written graph's (1.03 at most is the aim)."""
        if self.layergraph_ms is None or self.hand_written_ms is None:
            return None
        return self.layergraph_ms / self.hand_written_ms


def settings_for(name: str, settings: dict[str, Any], tiny: bool) -> dict[str, Any]:
    """An example's settings, made small with ``tiny``."""
    if not tiny:
        return dict(settings)
    return {**settings, **SMALL, **TINY_FIXES.get(name, {})}


HandGraph = Callable[..., Callable[..., Any]]
"""Makes the hand-written graph: ``plain_graph(model, **inputs)`` returns the replay."""


def measure_hand_written(
    row: Row,
    spec: TowerSpec,
    model: torch.nn.Module,
    inputs: dict[str, Any],
    want: torch.Tensor,
    *,
    hand_graph: HandGraph,
    device: torch.device,
    iters: int,
) -> None:
    """The hand-written graph's latency and error into ``row``; a failure recorded there."""
    changes = capture_changes(model, spec)
    row.hand_written_of = (
        "the whole tower, position ids as layergraph computes them"
        if changes
        else "the whole tower"
    )
    applied: list[Change] = []
    try:
        for change in changes:
            change.apply()
            applied.append(change)
        by_hand = hand_graph(model, **inputs)
        row.hand_written_error = relative_error(first_tensor(by_hand(**inputs)), want)
        row.hand_written_ms = waited_ms(lambda: by_hand(**inputs), device=device, iters=iters)
    except Exception as error:  # a capture the GPU refuses: recorded, the run goes on
        row.hand_written_failure = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        for change in reversed(applied):
            change.undo()


def measure(
    spec: TowerSpec,
    name: str,
    *,
    tiny: bool,
    device: torch.device,
    iters: int,
    hand_graph: HandGraph | None = None,
) -> Row:
    """One example configuration of ``spec`` at batch 1. ``hand_graph`` makes the hand-written
    graph (default: :func:`~layergraph.reference.plain_graph` on a GPU, none on the CPU)."""
    if hand_graph is None and device.type == "cuda":
        hand_graph = plain_graph
    example = TOWER_EXAMPLES[name][1]
    row = Row(family=spec.family, adapter=spec.adapter, model=name)
    try:
        tower_class = transformers_class(example.tower)
    except (ImportError, AttributeError):
        import transformers

        row.status = f"not in transformers {transformers.__version__}"
        return row
    settings = settings_for(name, example.settings, tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = build_tower(example.tower, settings, dtype, device)
    config = tower_class.config_class(**settings)
    size = pair(config.image_size if tiny else example.image_size or config.image_size)
    row.image_size = size[0]
    inputs = spec.inputs(config, 1, size, dtype, device)
    with torch.inference_mode():
        reference = wider_output(model, inputs)
        want = first_tensor(model(**inputs))
        row.eager_error = relative_error(want, reference)
        row.eager_ms = waited_ms(lambda: model(**inputs), device=device, iters=iters)
        if hand_graph is not None:
            measure_hand_written(
                row, spec, model, inputs, want, hand_graph=hand_graph, device=device, iters=iters
            )
        backend = None if device.type == "cuda" else SimulatedGraphs()
        graphed = layergraph.wrap(model, adapter=spec.adapter, backend=backend)
        graphed.capture(**inputs, progress=False)
        got = first_tensor(graphed(**inputs))
        row.relative_error = relative_error(got, want)
        row.layergraph_error = relative_error(got, reference)
        row.layergraph_ms = waited_ms(lambda: graphed(**inputs), device=device, iters=iters)
        ways = sorted(way for (_, way) in graphed.stats.served)
        reasons = sorted(graphed.stats.eager_calls)
        row.served = ", ".join(ways + [f"eager: {reason}" for reason in reasons])
        graphed.unwrap()
    tolerance = DEFAULT_TOLERANCE.get(dtype, 1e-4)
    row.within_tolerance = row.relative_error <= tolerance
    row.within_eager_error = row.layergraph_error <= ERROR_MARGIN * row.eager_error + 1e-12
    return row


ERROR_MARGIN = 1.1
"""How much larger than eager's own error against the wider copy layergraph's may be."""


def wider_output(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The first output tensor of a copy of ``model`` in a wider dtype (float32, or float64
    for a float32 model), given ``inputs``' floating tensors in it; the copy is dropped."""
    dtype = next(model.parameters()).dtype
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    copy = deepcopy(model).to(wide)
    widened = {
        name: value.to(wide) if torch.is_tensor(value) and value.is_floating_point() else value
        for name, value in inputs.items()
    }
    return first_tensor(copy(**widened)).clone()


def run(*, tiny: bool, models: set[str] | None, iters: int, device: torch.device) -> list[Row]:
    """A row for every example configuration (those named in ``models``, if given)."""
    rows = []
    for name, (spec, _) in TOWER_EXAMPLES.items():
        if models is None or name in models:
            rows.append(measure(spec, name, tiny=tiny, device=device, iters=iters))
            gc.collect()  # the tower and its graphs, before the next is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_table(rows: list[Row], title: str) -> None:
    """The rows as a table on the console (rich's, when installed)."""
    header = [
        "model",
        "adapter",
        "eager ms",
        "hand-written ms",
        "layergraph ms",
        "eager/layergraph",
        "layergraph/hand-written",
        "rel. error",
        "vs float32 (eager's)",
        "served",
    ]
    lines = [
        [
            row.model,
            row.adapter,
            _cell(row.eager_ms),
            "failed" if row.hand_written_failure else _cell(row.hand_written_ms),
            _cell(row.layergraph_ms),
            _cell(row.speedup, "x"),
            _cell(row.against_hand_written),
            "-" if row.relative_error is None else f"{row.relative_error:.1e}",
            _errors(row.layergraph_error, row.eager_error),
            row.served or row.status,
        ]
        for row in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for line in [header, *lines]:
            print(" | ".join(line))
        return
    table = Table(title=title)
    for column in header:
        table.add_column(column)
    for line in lines:
        table.add_row(*line)
    Console().print(table)


def markdown(record: dict[str, Any]) -> str:
    """The run as a section of ``docs/benchmark-runs.md``: how it was measured, one table."""
    lines = [
        "## Tower families at batch 1 (`benchmarks/families.py`)",
        "",
        f"{record['device']}, torch {record['torch']}, transformers {record['transformers']}, "
        f"{record['dtype']}, random weights; one image at each family's usual size, as its VLM "
        "sends it (Mllama: one image of four tiles); medians of "
        f"{record['iters']} calls each waited for, timed with CUDA events. The hand-written "
        "graph is the tower's whole forward captured with `torch.cuda.graph` (Idefics': with "
        "the position ids layergraph computes, the same values without boolean-mask indexing, "
        "which a capture refuses); one that fails says why; layergraph is "
        "`wrap(tower)` with default options. Errors are layergraph's first output against "
        "eager's (bf16's tolerance: 2e-2), and against a float32 copy's, eager's own in "
        "brackets.",
        "",
        "| family | configuration | image | eager ms | hand-written ms | layergraph ms | "
        "eager / layergraph | layergraph / hand-written | error | vs float32 (eager's) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in record["rows"]:
        if row["status"] != "measured":
            lines.append(
                f"| {row['family']} | {row['model']} | - | {row['status']}: checked on the "
                "CPU only (tests/test_coverage.py) | | | | | | |"
            )
            continue
        lines.append(
            f"| {row['family']} | {row['model']} | {row['image_size']} | "
            f"{_cell(row['eager_ms'])} | {_hand_cell(row)} | "
            f"{_cell(row['layergraph_ms'])} | {_cell(row['speedup'], 'x')} | "
            f"{_cell(row['against_hand_written'])} | {row['relative_error']:.1e} | "
            f"{_errors(row.get('layergraph_error'), row.get('eager_error'))} |"
        )
    return "\n".join(lines) + "\n"


def _errors(layergraph_error: float | None, eager_error: float | None) -> str:
    """layergraph's error against the wider copy, eager's in brackets."""
    if layergraph_error is None or eager_error is None:
        return "-"
    return f"{layergraph_error:.1e} ({eager_error:.1e})"


def _hand_cell(row: dict[str, Any]) -> str:
    """The hand-written graph's latency, or that it failed and why."""
    failure = row.get("hand_written_failure")
    return f"failed ({failure})" if failure else _cell(row["hand_written_ms"])


def _cell(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small towers, float32; any device")
    parser.add_argument("--models", default=None, help="comma-separated example names")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per method")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--markdown", default=None, help="write the docs section to this file")
    options = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not options.tiny:
        print("families.py needs a CUDA GPU; --tiny runs the same code path on the CPU")
        return 1
    import transformers

    device = torch.device("cuda" if cuda else "cpu")
    models = set(options.models.split(",")) if options.models else None
    rows = run(tiny=options.tiny, models=models, iters=options.iters, device=device)
    record = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "bfloat16" if cuda else "float32",
        "tiny": options.tiny,
        "batch": 1,
        "iters": options.iters,
        "rows": [
            {
                **asdict(row),
                "speedup": row.speedup,
                "against_hand_written": row.against_hand_written,
            }
            for row in rows
        ],
    }
    print_table(rows, f"batch 1 on {record['device']}, {record['dtype']}")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(record, handle, indent=2)
    if options.markdown:
        with open(options.markdown, "w") as handle:
            handle.write(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
