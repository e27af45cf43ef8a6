"""Qwen2.5-VL's, Qwen3-VL's, Qwen3.5's, GLM-4.1V's and Pixtral's packed vision towers:
transformers eager, layergraph, by hand.

    python3 benchmarks/packed_towers.py --json packed.json      # an H200: about 6 minutes
    python3 benchmarks/packed_towers.py --tiny --json tiny.json  # tiny towers, any machine

Towers are transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (Qwen2.5-VL-7B's vision
configuration), ``Qwen3VLVisionModel`` (Qwen3-VL-8B's), ``Qwen3_5VisionModel`` (its
configuration's defaults), ``Glm4vVisionModel`` (GLM-4.1V-9B's)
and ``PixtralVisionModel`` (Pixtral-12B's), built from their configurations with random
weights, in bf16; nothing is downloaded. For each tower:

- **images**: one image per call at 224x224, 448x448, 672x448, 896x896 and 1344x1008 (sides
  rounded to the tower's patch times merge size, as its processor does; for Pixtral, scaled
  to fit 1024 pixels a side and rounded up to whole patches), waited latency
  (medians of many calls, each waited for, CUDA events): the tower eager; layergraph's eager
  path (``wrap(..., lazy=False)``, every call served eagerly: what a call the policy sends to
  eager costs, which must be the tower's own); layergraph's ``wrap`` with
  ``attention="triton"`` and with its defaults (the budget and attention backends each chose),
  each size wrapped afresh and planning budgets from its first call (``observe_calls=0``: the
  stream measures the calls observed before a plan), as a server whose images come at that
  size serves them;
  a hand-written graph of the tower at that exact shape (``torch.cuda.graph`` around its
  forward given precomputed boundaries, positions and windows, attention through
  layergraph's Triton varlen kernel; Pixtral's own forward, given the image sizes on the
  host);
- **errors**: the relative error of eager, layergraph and the hand graph, each against a
  float32 copy of the same weights run eagerly;
- **stream**: 100 seeded requests of 1 to 3 entries (images of those sizes; for the Qwen and
  GLM towers some short videos, given to GLM-4.1V's tower as one row per frame, as its VLM
  does), each waited for:
  the total time of eager, of layergraph (its first pass, which captures, and a second), and
  of hand-written graphs captured for each request's exact shape (capture not counted);
  layergraph's graphs held, the budgets it chose from the traffic and how often, pool,
  capture seconds, and the pool of its largest budget captured alone; every answer compared
  with eager's. Captures and capture seconds count every graph captured, those dropped since
  (a replan, a graph not measured faster than eager) included, and each capture's whole cost: its
  buffers (where the attention backends are timed), warm-up, capture and measurement. The
  first pass includes the calls layergraph serves eagerly while it observes the traffic
  before choosing budgets (``eager_calls``). The targets of the packed mode are checked and
  reported (``targets``): at most 8 graphs, a pool at most 1.1x the largest budget's alone,
  captures under 3 s, the stream within 1.10x of the hand-written graphs.

A tower whose adapter refuses the installed transformers (every tower here is served with 5.17
to 5.24) is skipped, and the console and the JSON
(``skipped``) say so. ``--tiny`` runs four-layer towers
in float32, on the GPU if there is one, else on the CPU, where graphs are simulated and the
hand-written "graph" runs its forward eagerly, so that every code path of the benchmark runs
without a GPU. The console gets tables; ``--json`` gets every
number. The tower definitions, their inputs and the hand-written graphs are in
``qwen_towers.py`` and ``pixtral_towers.py`` beside it. What a VLM reads is compared: the
Qwen and GLM towers' merged features, Pixtral's last hidden state (asked for as Mistral 3
asks, the adapter given the layer Mistral 3 reads, ``feature_layers=-1``, as wrapping the VLM
sets it).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pixtral_towers
import qwen_towers
import torch
import transformers
from qwen_towers import Tower, build, frame_rows
from rich.console import Console
from rich.table import Table
from torch import nn

import layergraph
from layergraph import timing
from layergraph.testing import SimulatedGraphs
from layergraph.timing import waited_ms
from layergraph.validation import relative_error

SIZES = ((224, 224), (448, 448), (672, 448), (896, 896), (1344, 1008))
"""Image sizes (width, height) of the per-image table and the stream."""
TINY_SIZES = ((56, 56), (112, 112), (168, 112), (224, 224), (280, 224))
"""The same for the tiny towers."""


# ---- measuring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """How the run measures: device, dtype, the time each median may take, the stream."""

    device: torch.device
    dtype: torch.dtype
    seconds: float
    """Roughly how long each timed median runs (5 to 100 calls)."""
    requests: int
    seed: int
    sizes: tuple[tuple[int, int], ...]

    @property
    def simulated(self) -> bool:
        """Whether graphs are simulated (no GPU): layergraph's replays rerun the region."""
        return self.device.type != "cuda"


def waited(fn: Callable[[], Any], settings: Settings) -> float:
    """Median waited milliseconds of ``fn`` over as many calls as fit in ``settings.seconds``
    (5 to 100), after untimed calls (layergraph captures in the first)."""
    fn()
    fn()
    _, probe = timed_call(fn, settings)
    iters = int(min(100, max(5, settings.seconds * 1e3 / max(probe, 1e-3))))
    return waited_ms(fn, device=settings.device, warmup=1, iters=iters)


TARGETS = {"graphs": 8, "pool_vs_largest": 1.1, "capture_s": 3.0, "vs_hand": 1.10}
"""The packed mode's aims on the stream: graphs held, pool against the largest budget's
alone, capture seconds, layergraph's second pass against the exact-shape hand graphs."""


def towers(tiny: bool) -> list[Tower]:
    """Every tower measured: Qwen2.5-VL-7B's, Qwen3-VL-8B's, Qwen3.5's, GLM-4.1V-9B's and
    Pixtral-12B's (or tiny ones)."""
    return [*qwen_towers.towers(tiny), *pixtral_towers.towers(tiny)]


def wrap(
    model: nn.Module, settings: Settings, attention: str, kit: ModuleType, **options: Any
) -> Any:
    """layergraph's wrapper of ``model`` by its ``kit``'s adapter, with the kit's
    ``WRAP_OPTIONS`` where it has them (simulated graphs without a GPU)."""
    options.update(getattr(kit, "WRAP_OPTIONS", {}), adapter=kit.ADAPTER, attention=attention)
    if settings.simulated:
        options["backend"] = SimulatedGraphs()
    return layergraph.wrap(model, **options)


def variants(settings: Settings) -> dict[str, str]:
    """layergraph's variants by column name: the Triton kernel (its CPU stand-in without a
    GPU) and the defaults."""
    return {
        "layergraph_triton": "sdpa_varlen" if settings.simulated else "triton",
        "layergraph": "auto",
    }


def tokens_of(grids: list[tuple[int, int, int]]) -> int:
    """The patches of a call's entries (``(t, h, w)`` grids)."""
    return sum(t * h * w for t, h, w in grids)


def per_image(
    model: nn.Module, reference: nn.Module, settings: Settings, kit: ModuleType
) -> tuple[list[dict], dict[str, list[int]]]:
    """The per-image rows (waited latency of each method and each one's error against the
    reference: the same weights in a wider dtype, eager), and the budgets each layergraph
    variant held."""
    generator = torch.Generator().manual_seed(settings.seed)
    grids = [[kit.grid_for(model.config, *size)] for size in settings.sizes]
    inputs = [kit.pixels_for(model, entries, generator) for entries in grids]
    wide = next(reference.parameters())
    features = kit.features
    rows, wants, budgets = [], [], {}
    with torch.inference_mode():
        for (width, height), entries, (pixels, grid) in zip(settings.sizes, grids, inputs):
            want = features(kit.call(reference, pixels.to(wide), grid))
            wants.append(want)
            row: dict[str, Any] = {"size": f"{width}x{height}", "tokens": tokens_of(entries)}
            row["eager_ms"] = waited(functools.partial(kit.call, model, pixels, grid), settings)
            row["eager_error"] = relative_error(features(kit.call(model, pixels, grid)), want)
            by_hand = kit.HandGraph(model, pixels, grid)
            row["hand_graph_ms"] = waited(lambda h=by_hand, p=pixels: h(p), settings)
            row["hand_graph_error"] = relative_error(features(by_hand(pixels)), want)
            del by_hand
            rows.append(row)
        eager_path = wrap(model, settings, "auto", kit, lazy=False)
        for row, (pixels, grid), want in zip(rows, inputs, wants):
            call = functools.partial(kit.call, eager_path, pixels, grid)
            row["layergraph_eager_ms"] = waited(call, settings)
            row["layergraph_eager_error"] = relative_error(features(call()), want)
        eager_path.unwrap()
        for column, attention in variants(settings).items():
            budgets[column] = []
            for row, (pixels, grid), want in zip(rows, inputs, wants):
                graphed = wrap(model, settings, attention, kit, observe_calls=0)
                call = functools.partial(kit.call, graphed, pixels, grid)
                row[f"{column}_ms"] = waited(call, settings)
                row[f"{column}_error"] = relative_error(features(call()), want)
                budgets[column] += served([row], column, graphed)
                row[f"{column}_attention"] = graphed.plan.attention_by_budget.get(
                    next(iter(row[f"{column}_budgets"]), 0), "-"
                )
                graphed.release()
                graphed.unwrap()
    return rows, budgets


def served(rows: list[dict], column: str, graphed: Any) -> list[int]:
    """How layergraph served each row's calls (into the rows), and the budgets it held."""
    stats = graphed.stats
    for row in rows:
        row[f"{column}_served"] = sorted(
            way for tokens, way in stats.served if tokens == row["tokens"]
        )
        row[f"{column}_budgets"] = sorted(
            int(way.removeprefix("padded to ")) if way.startswith("padded") else tokens
            for tokens, way in stats.served
            if tokens == row["tokens"] and (way == "graph" or way.startswith("padded"))
        )
    return sorted(key.batch for key in graphed.keys)


def timed_call(fn: Callable[[], Any], settings: Settings) -> tuple[Any, float]:
    """One call of ``fn``, waited for: its output and milliseconds
    (:func:`layergraph.timing.timed_call` on the run's device)."""
    return timing.timed_call(fn, device=settings.device)


def stream(
    model: nn.Module, settings: Settings, video_rows: bool, kit: ModuleType
) -> dict[str, Any]:
    """The stream: totals of eager, layergraph (first and second pass) and exact-shape hand
    graphs, each call waited for, every answer compared with eager's. ``video_rows``: each
    video is given as one row per frame (:attr:`qwen_towers.Tower.video_rows`)."""
    requests = kit.stream_requests(model.config, settings.requests, settings.sizes, settings.seed)
    result: dict[str, Any] = {
        "requests": len(requests),
        "entries": sum(map(len, requests)),
        "videos": sum(t > 1 for grids in requests for t, _, _ in grids),
    }
    if video_rows:
        requests = [frame_rows(grids) for grids in requests]
    generator = torch.Generator().manual_seed(settings.seed + 1)
    inputs = [kit.pixels_for(model, grids, generator) for grids in requests]
    result["tokens"] = sum(map(tokens_of, requests))
    with torch.inference_mode():
        expected, total = [], 0.0
        for pixels, grid in inputs:
            output, ms = timed_call(functools.partial(kit.call, model, pixels, grid), settings)
            expected.append(kit.features(output))
            total += ms
        result["eager_s"] = total / 1e3
        graphed = wrap(model, settings, "auto", kit)
        for name in ("layergraph_first_pass", "layergraph"):
            total, worst = 0.0, 0.0
            for (pixels, grid), want in zip(inputs, expected):
                call = functools.partial(kit.call, graphed, pixels, grid)
                output, ms = timed_call(call, settings)
                total += ms
                worst = max(worst, relative_error(kit.features(output), want))
            result[f"{name}_s"], result[f"{name}_error"] = total / 1e3, worst
        stats = graphed.stats
        budgets = sorted(key.batch for key in graphed.keys)
        result.update(
            graphs=stats.graphs,
            budgets=budgets,
            budgets_chosen=list(stats.budgets),
            replans=stats.replans,
            attention=dict(graphed.plan.attention_by_budget),
            pool_mib=stats.pool_bytes / 2**20,
            capture_s=stats.capture_seconds,
            captures=stats.captures,
            slower_graphs=stats.slower_graphs,
            eager_calls=dict(stats.eager_calls),
            served={f"{tokens} {way}": n for (tokens, way), n in sorted(stats.served.items())},
        )
        graphed.release()
        graphed.unwrap()
        result["largest_budget_pool_mib"] = largest_alone(model, settings, budgets, kit)
        result.update(hand_graphs(model, settings, requests, inputs, expected, kit))
    result["targets"] = targets(result)
    return result


def targets(stream: dict[str, Any]) -> dict[str, Any]:
    """Each aim of :data:`TARGETS`: the value reached on the stream and whether it is met
    (``None`` where it could not be measured)."""
    alone, hand = stream["largest_budget_pool_mib"], stream["hand_graph_s"]
    reached = {
        "graphs": stream["graphs"],
        "pool_vs_largest": stream["pool_mib"] / alone if alone else None,
        "capture_s": stream["capture_s"],
        "vs_hand": stream["layergraph_s"] / hand if hand else None,
    }
    return {
        name: {
            "value": value,
            "aim": TARGETS[name],
            "met": None if value is None else value <= TARGETS[name],
        }
        for name, value in reached.items()
    }


def largest_alone(
    model: nn.Module, settings: Settings, budgets: list[int], kit: ModuleType
) -> float | None:
    """The pool of the largest budget held, captured alone in a fresh wrapper given that budget
    (MiB): one image of exactly that many patches, 16 high (8 where that leaves an odd width,
    which a merge of 2x2 patches cannot take)."""
    if not budgets:
        return None
    generator = torch.Generator().manual_seed(settings.seed + 2)
    height = 16 if budgets[-1] % 32 == 0 else 8
    pixels, grid = kit.pixels_for(model, [(1, height, budgets[-1] // height)], generator)
    graphed = wrap(model, settings, "auto", kit, batch_sizes=budgets[-1:])
    with torch.inference_mode():
        kit.call(graphed, pixels, grid)
    held = [key.batch for key in graphed.keys]
    mib = graphed.stats.pool_bytes / 2**20 if held == budgets[-1:] else None
    graphed.release()
    graphed.unwrap()
    return mib


def hand_graphs(
    model: nn.Module,
    settings: Settings,
    requests: list[list[tuple[int, int, int]]],
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    expected: list[torch.Tensor],
    kit: ModuleType,
) -> dict[str, Any]:
    """Each distinct request shape captured by hand and replayed for its requests, one shape
    at a time (so that their memory is not held together): total replay time, capture time."""
    by_shape: dict[tuple, list[int]] = {}
    for index, grids in enumerate(requests):
        by_shape.setdefault(tuple(grids), []).append(index)
    total, capture, worst = 0.0, 0.0, 0.0
    for indices in by_shape.values():
        pixels, grid = inputs[indices[0]]
        started = time.perf_counter()
        by_hand = kit.HandGraph(model, pixels, grid)
        capture += time.perf_counter() - started
        for index in indices:
            pixels, _ = inputs[index]
            output, ms = timed_call(lambda h=by_hand, p=pixels: h(p), settings)
            total += ms
            worst = max(worst, relative_error(kit.features(output), expected[index]))
        del by_hand
    return {
        "hand_graphs": len(by_shape),
        "hand_graph_s": total / 1e3,
        "hand_graph_capture_s": capture,
        "hand_graph_error": worst,
    }


def measure(tower: Tower, settings: Settings) -> dict[str, Any]:
    """Every section for one tower."""
    kit = importlib.import_module(tower.kit)
    model = build(tower, settings.dtype, settings.device)
    reference_dtype = torch.float64 if settings.dtype == torch.float32 else torch.float32
    reference = copy.deepcopy(model).to(reference_dtype)
    record: dict[str, Any] = {
        "tower": tower.name,
        "config": {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")},
        "attention_implementation": model.config._attn_implementation,
        "reference_dtype": str(reference_dtype),
    }
    record["images"], record["image_budgets"] = per_image(model, reference, settings, kit)
    del reference
    if settings.device.type == "cuda":
        torch.cuda.empty_cache()
    record["stream"] = stream(model, settings, tower.video_rows, kit)
    del model
    if settings.device.type == "cuda":
        torch.cuda.empty_cache()
    return record


# ---- report ----------------------------------------------------------------------------------


def ratio(numerator: float | None, denominator: float | None) -> str:
    """``numerator / denominator`` as ``2.41x``, or a dash."""
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def image_table(record: dict[str, Any]) -> Table:
    """Waited milliseconds per image (speedup over eager) and errors against the reference."""
    table = Table(title=f"{record['tower']}: one image per call, waited ms (x eager)")
    methods = {
        "layergraph_eager": "lg eager path",
        "layergraph_triton": "lg triton",
        "layergraph": "lg",
        "hand_graph": "hand graph",
    }
    for column in ("size", "tokens", "eager", *methods.values(), "lg / hand", "lg attention"):
        table.add_column(column, justify="right")
    for name in ("eager", "lg", "hand"):
        table.add_column(f"error {name}", justify="right")
    for row in record["images"]:
        eager = row["eager_ms"]
        table.add_row(
            row["size"],
            str(row["tokens"]),
            f"{eager:.2f}",
            *(f"{row[f'{name}_ms']:.2f} ({ratio(eager, row[f'{name}_ms'])})" for name in methods),
            ratio(row["layergraph_ms"], row["hand_graph_ms"]),
            row["layergraph_attention"],
            *(f"{row[f'{name}_error']:.1e}" for name in ("eager", "layergraph", "hand_graph")),
        )
    return table


def seconds(stream: dict[str, Any], name: str) -> str:
    """A stream total and its speedup over eager."""
    return f"{stream[name]:.3f} ({ratio(stream['eager_s'], stream[name])})"


def stream_table(records: list[dict[str, Any]]) -> Table:
    """The stream's totals per tower and method."""
    table = Table(title="stream: total seconds, each call waited for (x eager)")
    for column in (
        "tower",
        "requests",
        "eager",
        "lg first pass",
        "lg",
        "hand graphs",
        "lg / hand",
        "graphs",
        "budgets chosen",
        "pool MiB",
        "largest alone MiB",
        "capture s",
    ):
        table.add_column(column, justify="right")
    for record in records:
        s = record["stream"]
        alone = s["largest_budget_pool_mib"]
        table.add_row(
            record["tower"],
            f"{s['requests']} ({s['entries']} entries, {s['videos']} videos)",
            f"{s['eager_s']:.3f}",
            seconds(s, "layergraph_first_pass_s"),
            seconds(s, "layergraph_s"),
            seconds(s, "hand_graph_s") + f" {s['hand_graphs']} graphs",
            ratio(s["layergraph_s"], s["hand_graph_s"]),
            str(s["graphs"]),
            f"{', '.join(map(str, s['budgets_chosen']))} ({s['replans']}x)",
            f"{s['pool_mib']:.0f}",
            f"{alone:.0f}" if alone is not None else "-",
            f"{s['capture_s']:.2f} ({s['captures']} captures)",
        )
    return table


def targets_table(records: list[dict[str, Any]]) -> Table:
    """Whether each tower's stream met the packed mode's aims."""
    table = Table(title="stream: the packed mode's aims (value, aim)")
    table.add_column("tower")
    for name in TARGETS:
        table.add_column(name, justify="right")
    for record in records:
        cells = []
        for goal in record["stream"]["targets"].values():
            value = "-" if goal["value"] is None else f"{goal['value']:.2f}"
            verdict = {True: "met", False: "MISSED", None: "?"}[goal["met"]]
            cells.append(f"{value} <= {goal['aim']} {verdict}")
        table.add_row(record["tower"], *cells)
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument("--tiny", action="store_true", help="four-layer towers in float32")
    parser.add_argument("--towers", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--requests", type=int, default=None, help="stream length (100; 12 tiny)")
    parser.add_argument("--seconds", type=float, default=None, help="per median (1.5; 0.05 tiny)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.tiny and not cuda:
        parser.error("the full-size towers need a CUDA GPU; --tiny runs anywhere")
    settings = Settings(
        device=torch.device("cuda" if cuda else "cpu"),
        dtype=torch.float32 if args.tiny else torch.bfloat16,
        seconds=args.seconds if args.seconds is not None else (0.05 if args.tiny else 1.5),
        requests=args.requests if args.requests is not None else (12 if args.tiny else 100),
        seed=args.seed,
        sizes=TINY_SIZES if args.tiny else SIZES,
    )
    chosen = towers(args.tiny)
    if args.towers:
        names = args.towers.split(",")
        unknown = sorted(set(names) - {tower.name for tower in chosen})
        if unknown:
            parser.error(f"unknown towers {unknown}; choose from {[t.name for t in chosen]}")
        chosen = [tower for tower in chosen if tower.name in names]
    skipped = {tower.name: tower.served_with for tower in chosen if not tower.served_here()}
    chosen = [tower for tower in chosen if tower.name not in skipped]
    started = time.perf_counter()
    console = Console(width=max(Console().width, 150))
    for name, releases in skipped.items():
        console.print(
            f"{name} skipped: layergraph serves it with transformers{releases}, and "
            f"{transformers.__version__} is installed"
        )
    records = []
    for tower in chosen:
        records.append(measure(tower, settings))
        console.print(image_table(records[-1]))
    console.print(stream_table(records))
    console.print(targets_table(records))
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "graphs": "simulated" if settings.simulated else "cuda",
        "dtype": str(settings.dtype),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "seed": args.seed,
        "seconds": time.perf_counter() - started,
        "towers": records,
        "skipped": skipped,
    }
    console.print(f"{result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
