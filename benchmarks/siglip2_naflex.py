"""SigLIP2 NaFlex towers on one GPU: transformers eager, layergraph, a hand-written graph.

    python3 benchmarks/siglip2_naflex.py --json siglip2.json      # an H200: a few minutes
    python3 benchmarks/siglip2_naflex.py --tower lfm2-vl-1.6b --json lfm2-vl-1.6b.json
    python3 benchmarks/siglip2_naflex.py --tiny --json tiny.json  # a tiny tower, any machine
    python3 benchmarks/siglip2_naflex.py --no-stream --options fuse_norm=auto,fuse_gelu=auto

The tower (``--tower``, :data:`TOWERS`) is transformers' ``Siglip2VisionModel`` with random
weights, bf16; nothing is downloaded:

- ``siglip2-so400m`` (the default): SigLIP2 so400m/16 NaFlex's configuration (27 layers, width
  1152, 16 heads, 16-pixel patches, a 16x16 position table, the pooling head). A call holds
  images of several aspect ratios, each given the largest patch grid of at most
  ``max_patches`` patches (SigLIP2's processor's own rule) and padded to ``max_patches``, as
  the processor returns them;
- ``lfm2-vl-450m`` and ``lfm2-vl-1.6b``: the towers LFM2-VL builds, SigLIP2 base/16 NaFlex's
  (12 layers, width 768, 12 heads) and so400m/16 NaFlex's configurations without the pooling
  head. A call holds photos made into LFM2-VL's inputs by its own image processor
  (``Lfm2VlImageProcessor``): a photo above 256 image tokens cut into 512-pixel tiles (with a
  thumbnail for LFM2-VL-1.6B), a smaller one resized whole, every image padded to 1024
  patches; ``images`` counts photos, ``encoded_images`` what the tower is given.

Sections:

- **calls**: batches of 1 to 8 images at 256 and 1024 patches (1 to 4 photos for LFM2-VL's towers),
  waited latency (medians of many calls, each waited for, CUDA events): the tower eager;
  layergraph's ``wrap`` with its defaults and with ``attention="triton"``, or with each attention
  setting ``--attention`` names (the real patches packed per token budget; each row wrapped
  afresh, planned from its first call: ``observe_calls=0``; each row records the budget that
  served it and that budget's attention backend);
  a hand-written graph of the tower's own forward at that padded shape (``torch.cuda.graph``,
  new pixels, masks and grids copied in: transformers 5.24 resizes the
  position table on the device from ``spatial_shapes``; up to 5.23, whose resize reads the grids
  on the host, which no capture allows, each call resizes it outside the graph, by the tower's own
  resize, into a buffer the graph reads), and each one's error against the same weights in
  float32, eager, over the real patches of ``last_hidden_state`` and ``pooler_output`` (where the
  tower has a pooling head). Each layergraph setting is timed in turns with the hand-written graph
  (five rounds), so that drift during the run weighs on both alike: ``<column>_vs_hand`` is
  that pair's ratio, and ``hand_graph_ms`` the median of the hand-written graph's turns;
- **stream**: seeded requests of 1 to 8 images at 256 or 1024 patches (1 to 3 photos for LFM2-VL's
  towers), each waited for: the total of eager, of layergraph (its first pass, which captures, and a
  second) and of hand-written graphs, one per padded shape (captures not counted); layergraph's
  graphs, budgets, pool and capture seconds; every answer compared with eager's. ``--no-stream``
  leaves it out.

``--tiny`` runs a four-layer tower of the same kind in float32 (LFM2-VL's processor with 4-pixel
patches, 32-pixel tiles and photos a sixteenth of the size), on the GPU if there is one, else on the
CPU, where layergraph's graphs and the hand-written ones are simulated (layergraph's Triton column
runs ``sdpa_varlen``; a simulated capture refuses what a CUDA graph capture refuses, such as a
tensor read on the host), so that every code path runs without a GPU. A hand-written graph that
cannot be captured is reported with its error, not timed. The console gets the rows; ``--json``
every number.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from packaging.specifiers import SpecifierSet
from torch import nn
from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor
from transformers.models.siglip2.image_processing_siglip2 import (
    get_image_size_for_max_num_patches,
)

import layergraph
from layergraph import timing
from layergraph.reference import plain_graph
from layergraph.testing import SimulatedGraphs
from layergraph.timing import interleaved_waited_ms, waited_ms
from layergraph.validation import relative_error
from layergraph_adapters.example_models.packed import PACKED_EXAMPLES

SO400M = dict(PACKED_EXAMPLES["siglip2-so400m-naflex"].example.settings)
"""``Siglip2VisionConfig`` of SigLIP2 so400m/16 NaFlex."""
BASE = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    patch_size=16,
    num_patches=256,
)
"""``Siglip2VisionConfig`` of SigLIP2 base/16 NaFlex."""
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    patch_size=4,
    num_patches=64,
)
PHOTOS = ((640, 480), (480, 640), (1920, 1080), (1080, 1920), (512, 512), (1200, 300), (96, 640))
"""Image sizes (width, height) in pixels, from landscape to a tall strip."""
CALLS = ((1, 256), (2, 256), (4, 256), (8, 256), (1, 1024), (4, 1024))
"""The calls section's (images, max_patches)."""
TINY_CALLS = ((1, 16), (2, 16), (4, 16), (8, 16), (1, 64), (4, 64))
TINY_LFM2_VL = dict(encoder_patch_size=4, tile_size=32, min_image_tokens=4, max_image_tokens=16)
"""LFM2-VL's image processor for the tiny towers: 4-pixel patches, tiles of 8x8 patches."""


@dataclass(frozen=True)
class NaflexTower:
    """A tower to measure: its configuration, the calls section's calls and how a call's
    images are made."""

    name: str
    config: dict[str, Any]
    calls: tuple[tuple[int, int], ...]
    """The calls section's (images, max_patches): images are photos for LFM2-VL's towers, and
    max_patches the processor's."""
    processor: dict[str, Any] | None = None
    """LFM2-VL's image processor's settings, for the towers LFM2-VL builds: photos made into
    tiles, thumbnails and whole images by it. ``None``: one image per photo, SigLIP2's rule."""
    photo_scale: int = 1
    """Photos are :data:`PHOTOS` divided by it (LFM2-VL's tiny towers: 16)."""
    most_photos: int = 8
    """The most photos a request of the stream holds."""


def lfm2_vl_tower(name: str, config: dict[str, Any], tiny: bool, **processor: Any) -> NaflexTower:
    """A tower as LFM2-VL builds it (no pooling head), given photos through its image processor
    (``processor``: settings besides its defaults)."""
    if tiny:
        config, processor = TINY, {**processor, **TINY_LFM2_VL}
    patches = Lfm2VlImageProcessor(**processor).max_num_patches
    return NaflexTower(
        name=name,
        config={**config, "vision_use_head": False},
        calls=tuple((photos, patches) for photos in (1, 2, 4)),
        processor=processor,
        photo_scale=16 if tiny else 1,
        most_photos=3,
    )


TOWERS: dict[str, Callable[[bool], NaflexTower]] = {
    "siglip2-so400m": lambda tiny: NaflexTower(
        "siglip2-so400m", TINY if tiny else SO400M, TINY_CALLS if tiny else CALLS
    ),
    "lfm2-vl-450m": lambda tiny: lfm2_vl_tower("lfm2-vl-450m", BASE, tiny, use_thumbnail=False),
    "lfm2-vl-1.6b": lambda tiny: lfm2_vl_tower("lfm2-vl-1.6b", SO400M, tiny),
}
"""Each tower ``--tower`` names, full size or tiny (``--tiny``)."""


@dataclass(frozen=True)
class Settings:
    """How the run measures: device, dtype, the time each median may take, the stream."""

    device: torch.device
    dtype: torch.dtype
    seconds: float
    """Roughly how long each timed median runs (5 to 100 calls)."""
    requests: int
    seed: int
    tower: NaflexTower
    attention: tuple[str, ...] = ("auto", "triton")
    """layergraph's attention settings, one column each: ``layergraph`` for ``auto``,
    ``layergraph_<name>`` for a backend named."""
    options: dict[str, Any] = field(default_factory=dict)
    """Other ``wrap`` options every layergraph wrapper is given (``--options``)."""

    @property
    def simulated(self) -> bool:
        """Whether graphs are simulated (no GPU): replays rerun the captured region."""
        return self.device.type != "cuda"


def naflex_call(
    model: nn.Module, images: int, max_patches: int, rng: random.Random, settings: Settings
) -> dict[str, torch.Tensor]:
    """A padded batch of ``images`` random photos (sizes from :data:`PHOTOS`), as SigLIP2's
    processor gives it at ``max_patches``, or LFM2-VL's (:attr:`NaflexTower.processor`)."""
    photos = rng.choices(PHOTOS, k=images)
    if settings.tower.processor is not None:
        return lfm2_vl_call(photos, rng, settings)
    patch = model.config.patch_size
    grids = []
    for width, height in photos:
        rows, columns = get_image_size_for_max_num_patches(height, width, patch, max_patches)
        grids.append((rows // patch, columns // patch))
    mask = torch.zeros(images, max_patches, dtype=torch.int32)
    for row, (height, width) in enumerate(grids):
        mask[row, : height * width] = 1
    generator = torch.Generator().manual_seed(rng.randrange(1 << 31))
    features = model.config.num_channels * patch * patch
    pixels = torch.randn(images, max_patches, features, generator=generator) * mask[..., None]
    return {
        "pixel_values": pixels.to(settings.device, settings.dtype),
        "pixel_attention_mask": mask.to(settings.device),
        "spatial_shapes": torch.tensor(grids, device=settings.device),
    }


def lfm2_vl_call(
    photos: list[tuple[int, int]], rng: random.Random, settings: Settings
) -> dict[str, torch.Tensor]:
    """Random ``photos`` (width, height, divided by :attr:`NaflexTower.photo_scale`) made into a
    call by LFM2-VL's image processor."""
    tower = settings.tower
    generator = torch.Generator().manual_seed(rng.randrange(1 << 31))
    images = [
        torch.randint(
            0,
            256,
            (3, max(8, height // tower.photo_scale), max(8, width // tower.photo_scale)),
            dtype=torch.uint8,
            generator=generator,
        )
        for width, height in photos
    ]
    batch = Lfm2VlImageProcessor(**tower.processor)(images, return_tensors="pt")
    return {
        "pixel_values": batch["pixel_values"].to(settings.device, settings.dtype),
        "pixel_attention_mask": batch["pixel_attention_mask"].to(settings.device),
        "spatial_shapes": batch["spatial_shapes"].to(settings.device),
    }


def answer(output: Any, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What callers read: ``last_hidden_state`` at the real patches, and ``pooler_output``
    where the tower has a pooling head."""
    real = inputs["pixel_attention_mask"].bool()
    pooled = [] if output.pooler_output is None else [output.pooler_output]
    return [output.last_hidden_state[real], *pooled]


def error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The worst relative error over the parts of an answer."""
    return max(relative_error(part, expected) for part, expected in zip(got, want))


@contextlib.contextmanager
def host_checks_off() -> Iterator[None]:
    """transformers' input checks off (``TRANSFORMERS_DISABLE_TORCH_CHECK``): they read tensors
    on the host, which a CUDA graph capture forbids."""
    before = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"]
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = before


SIMULATED_ATTENTION = ("auto", "sdpa_varlen")
"""The attention settings that run without a GPU; the others are measured with
``sdpa_varlen`` there."""


RESIZES_ON_HOST = "<5.24"
"""The transformers releases whose ``Siglip2VisionEmbeddings.resize_positional_embeddings`` reads
``spatial_shapes`` on the host (``.tolist()``, then an ``F.interpolate`` per image at those sizes),
which a CUDA graph capture refuses; from 5.24 it resizes on the device from ``spatial_shapes``."""


def resizes_on_host() -> bool:
    """Whether the installed transformers resizes the position table from grids read on the host
    (:data:`RESIZES_ON_HOST`)."""
    return SpecifierSet(RESIZES_ON_HOST).contains(transformers.__version__, prereleases=True)


def resized_positions(model: nn.Module, spatial_shapes: torch.Tensor, length: int) -> torch.Tensor:
    """The position embeddings the tower's forward adds to its patches for ``spatial_shapes``
    padded to ``length`` patches, made by its own ``resize_positional_embeddings`` as its forward
    makes them."""
    embeddings = model.embeddings
    side = embeddings.position_embedding_size
    table = embeddings.position_embedding.weight.reshape(side, side, -1)
    resize = type(embeddings).resize_positional_embeddings
    return resize(table, spatial_shapes, max_length=length)


@contextlib.contextmanager
def positions_from(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Within, the tower's embeddings take their resized position embeddings from ``positions``
    instead of resizing the table; the rest of the tower's forward runs as it is."""
    embeddings = model.embeddings

    def given(table: torch.Tensor, spatial_shapes: torch.Tensor, max_length: int) -> torch.Tensor:
        return positions

    embeddings.resize_positional_embeddings = given
    try:
        yield
    finally:
        del embeddings.resize_positional_embeddings


def simulated_plain_graph(
    model: nn.Module, *, warmup_runs: int = 3, **kwargs: torch.Tensor
) -> Callable[..., Any]:
    """:func:`~layergraph.reference.plain_graph` on the CPU, through
    :class:`~layergraph.testing.SimulatedGraphs`: static inputs, a capture that refuses what a
    CUDA graph capture refuses (a tensor read on the host, ...), and replays that copy new inputs
    in, rerun the forward and write its answer into the captured output."""
    backend = SimulatedGraphs()
    static = {name: value.clone() for name, value in kwargs.items()}
    graph, output = backend.capture(lambda: model(**static), backend.new_pool(), warmup_runs)

    def run(**new: torch.Tensor) -> Any:
        for name, value in new.items():
            static[name].copy_(value)
        backend.replay(graph)
        return output

    return run


def hand_graph(
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[Callable[..., Any] | None, str | None]:
    """The tower's own forward at the padded shape of ``inputs``, captured by hand
    (:func:`~layergraph.reference.plain_graph`; on the CPU :func:`simulated_plain_graph`), or
    ``None`` and why the capture failed.

    Where transformers resizes the position table from grids read on the host
    (:func:`resizes_on_host`), the graph takes the resized position embeddings from a buffer
    instead, and each call writes them there first, by the tower's own resize of its grids
    (read on the host once), outside the graph: every other part of the forward is replayed."""
    capture = plain_graph if inputs["pixel_values"].device.type == "cuda" else simulated_plain_graph
    try:
        with host_checks_off():
            if not resizes_on_host():
                return capture(model, **inputs), None
            length = inputs["pixel_values"].shape[1]
            positions = resized_positions(model, inputs["spatial_shapes"].cpu(), length)
            with positions_from(model, positions):
                graph = capture(model, **inputs)
    except Exception as failure:  # a forward that cannot be captured: reported, not fatal
        return None, f"{type(failure).__name__}: {failure}"

    def run(**new: torch.Tensor) -> Any:
        positions.copy_(resized_positions(model, new["spatial_shapes"].cpu(), length))
        with positions_from(model, positions):
            return graph(**new)

    return run, None


def waited(fn: Callable[[], Any], settings: Settings) -> float:
    """Median waited milliseconds of ``fn`` over as many calls as fit in ``settings.seconds``
    (5 to 100), after an untimed call (layergraph captures in it) and a timed probe."""
    fn()
    _, probe = timed_call(fn, settings)
    iters = int(min(100, max(5, settings.seconds * 1e3 / max(probe, 1e-3))))
    return waited_ms(fn, device=settings.device, warmup=1, iters=iters)


def in_turns(methods: dict[str, Callable[[], Any]], settings: Settings) -> dict[str, float]:
    """Median waited milliseconds of each method, timed in turns
    (:func:`~layergraph.timing.interleaved_waited_ms`: five rounds) over as many calls as fit
    in ``settings.seconds`` for each (5 to 100), after an untimed call of each (layergraph
    captures in it) and a timed probe."""
    probes = []
    for method in methods.values():
        method()
        probes.append(timed_call(method, settings)[1])
    rounds = 5
    iters = int(min(100, max(5, settings.seconds * 1e3 / max(max(probes), 1e-3))))
    return interleaved_waited_ms(
        methods, device=settings.device, rounds=rounds, iters=max(1, iters // rounds)
    )


def timed_call(fn: Callable[[], Any], settings: Settings) -> tuple[Any, float]:
    """One call of ``fn``, waited for: its output and milliseconds
    (:func:`layergraph.timing.timed_call` on the run's device)."""
    return timing.timed_call(fn, device=settings.device)


def wrap_options(text: str) -> dict[str, Any]:
    """``NAME=VALUE,...`` as ``wrap`` options: ``true`` and ``false`` as booleans, others as
    given."""
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        options[name] = {"true": True, "false": False}.get(value.lower(), value)
    return options


def wrap(model: nn.Module, settings: Settings, attention: str = "auto", **options: Any) -> Any:
    """layergraph's wrapper of ``model`` (simulated graphs without a GPU)."""
    backend = SimulatedGraphs() if settings.simulated else None
    return layergraph.wrap(
        model,
        adapter="siglip2",
        attention=attention,
        backend=backend,
        **{**settings.options, **options},
    )


def calls(model: nn.Module, settings: Settings) -> list[dict[str, Any]]:
    """The calls section: one row per (images, max_patches)."""
    reference = copy.deepcopy(model).to(torch.float64 if settings.simulated else torch.float32)
    wide = next(reference.parameters()).dtype
    rng = random.Random(settings.seed)
    calls = settings.tower.calls
    inputs = [naflex_call(model, n, patches, rng, settings) for n, patches in calls]
    rows, wants = [], []
    with torch.inference_mode():
        for (images, patches), batch in zip(calls, inputs):
            wide_batch = dict(batch, pixel_values=batch["pixel_values"].to(wide))
            want = answer(reference(**wide_batch), batch)
            wants.append(want)
            real = int(batch["pixel_attention_mask"].sum())
            row: dict[str, Any] = {
                "images": images,
                "encoded_images": batch["pixel_values"].shape[0],
                "max_patches": patches,
                "tokens": real,
            }
            row["eager_ms"] = waited(lambda b=batch: model(**b), settings)
            row["eager_error"] = error(answer(model(**batch), batch), want)
            by_hand, failure = hand_graph(model, batch)
            if by_hand is None:
                row["hand_graph_failure"] = failure
            else:
                row["hand_graph_error"] = error(answer(by_hand(**batch), batch), want)
            paired = []
            for attention in settings.attention:
                column = "layergraph" if attention == "auto" else f"layergraph_{attention}"
                if settings.simulated and attention not in SIMULATED_ATTENTION:
                    attention = "sdpa_varlen"
                graphed = wrap(model, settings, attention, observe_calls=0)
                methods = {column: lambda g=graphed, b=batch: g(**b)}
                if by_hand is not None:
                    methods["hand_graph"] = lambda h=by_hand, b=batch: h(**b)
                times = in_turns(methods, settings)
                row[f"{column}_ms"] = times[column]
                if by_hand is not None:
                    paired.append(times["hand_graph"])
                    row[f"{column}_vs_hand"] = times[column] / times["hand_graph"]
                row[f"{column}_error"] = error(answer(graphed(**batch), batch), want)
                row[f"{column}_served"] = sorted(
                    way for tokens, way in graphed.stats.served if tokens == row["tokens"]
                )
                budget = served_budget(graphed, row["tokens"])
                row[f"{column}_budget"] = budget
                row[f"{column}_attention"] = graphed.plan.attention_by_budget.get(budget, "-")
                graphed.release()
                graphed.unwrap()
            if paired:
                row["hand_graph_ms"] = statistics.median(paired)
            del by_hand
            rows.append(row)
        del reference
    return rows


def served_budget(graphed: Any, tokens: int) -> int | None:
    """The budget whose graph served the calls of ``tokens`` real tokens, or ``None`` where
    they ran eagerly."""
    for (served, way), _ in graphed.stats.served.items():
        if served == tokens and way == "graph":
            return tokens
        if served == tokens and way.startswith("padded to "):
            return int(way.removeprefix("padded to "))
    return None


def stream(model: nn.Module, settings: Settings) -> dict[str, Any]:
    """The stream: totals of eager, layergraph (first and second pass) and hand-written graphs
    per padded shape, each call waited for, every answer compared with eager's."""
    rng = random.Random(settings.seed + 1)
    shapes = sorted({patches for _, patches in settings.tower.calls})
    most = settings.tower.most_photos
    inputs = [
        naflex_call(model, rng.randint(1, most), rng.choice(shapes), rng, settings)
        for _ in range(settings.requests)
    ]
    result: dict[str, Any] = {
        "requests": len(inputs),
        "images": sum(batch["pixel_values"].shape[0] for batch in inputs),
        "tokens": sum(int(batch["pixel_attention_mask"].sum()) for batch in inputs),
        "padded_tokens": sum(batch["pixel_attention_mask"].numel() for batch in inputs),
    }
    with torch.inference_mode():
        expected, total = [], 0.0
        for batch in inputs:
            output, ms = timed_call(lambda b=batch: model(**b), settings)
            expected.append(answer(output, batch))
            total += ms
        result["eager_s"] = total / 1e3
        graphed = wrap(model, settings)
        for name in ("layergraph_first_pass", "layergraph"):
            total, worst = 0.0, 0.0
            for batch, want in zip(inputs, expected):
                output, ms = timed_call(lambda b=batch: graphed(**b), settings)
                total += ms
                worst = max(worst, error(answer(output, batch), want))
            result[f"{name}_s"], result[f"{name}_error"] = total / 1e3, worst
        stats = graphed.stats
        result.update(
            graphs=stats.graphs,
            budgets=sorted(key.batch for key in graphed.keys),
            pool_mib=stats.pool_bytes / 2**20,
            capture_s=stats.capture_seconds,
            eager_calls=dict(stats.eager_calls),
        )
        graphed.release()
        graphed.unwrap()
        result.update(hand_graphs(model, inputs, expected, settings))
    return result


def hand_graphs(
    model: nn.Module,
    inputs: list[dict[str, torch.Tensor]],
    expected: list[list[torch.Tensor]],
    settings: Settings,
) -> dict[str, Any]:
    """Each padded shape of the stream captured by hand once and replayed for its requests, one
    shape at a time (so that their memory is not held together)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for index, batch in enumerate(inputs):
        by_shape.setdefault(tuple(batch["pixel_values"].shape), []).append(index)
    total, capture, worst, failures = 0.0, 0.0, 0.0, []
    for indices in by_shape.values():
        started = time.perf_counter()
        by_hand, failure = hand_graph(model, inputs[indices[0]])
        capture += time.perf_counter() - started
        if by_hand is None:
            failures.append(failure)
            continue
        for index in indices:
            batch = inputs[index]
            output, ms = timed_call(lambda h=by_hand, b=batch: h(**b), settings)
            total += ms
            worst = max(worst, error(answer(output, batch), expected[index]))
        del by_hand
    return {
        "hand_graphs": len(by_shape),
        "hand_graph_s": total / 1e3,
        "hand_graph_capture_s": capture,
        "hand_graph_error": worst,
        "hand_graph_failures": failures,
    }


def tower_model(settings: Settings) -> nn.Module:
    """The tower of ``settings``, with random weights seeded by ``settings.seed``, in
    ``settings.dtype`` on ``settings.device``, for inference."""
    torch.manual_seed(settings.seed)
    config = transformers.Siglip2VisionConfig(**settings.tower.config)
    with torch.device(settings.device):
        model = transformers.Siglip2VisionModel(config)
    return model.to(settings.dtype).eval()


def rounded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its floats to four significant digits, for the console."""
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in record.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument("--tower", choices=sorted(TOWERS), default="siglip2-so400m")
    parser.add_argument("--tiny", action="store_true", help="a four-layer tower in float32")
    parser.add_argument("--requests", type=int, default=None, help="stream length (100; 8 tiny)")
    parser.add_argument("--seconds", type=float, default=None, help="per median (1.0; 0.05 tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention",
        default="auto,triton",
        help="comma-separated attention settings, one column each (auto, or backends' names)",
    )
    parser.add_argument("--no-stream", action="store_true", help="the calls section only")
    parser.add_argument(
        "--options",
        default="",
        help="wrap options for every layergraph wrapper, NAME=VALUE,... (true, false or a string)",
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.tiny and not cuda:
        parser.error(f"the {args.tower} tower needs a CUDA GPU; --tiny runs anywhere")
    settings = Settings(
        device=torch.device("cuda" if cuda else "cpu"),
        dtype=torch.float32 if args.tiny else torch.bfloat16,
        seconds=args.seconds if args.seconds is not None else (0.05 if args.tiny else 1.0),
        requests=args.requests if args.requests is not None else (8 if args.tiny else 100),
        seed=args.seed,
        tower=TOWERS[args.tower](args.tiny),
        attention=tuple(args.attention.split(",")),
        options=wrap_options(args.options),
    )
    model = tower_model(settings)
    started = time.perf_counter()
    rows = calls(model, settings)
    for row in rows:
        print(rounded(row))
    streamed = None if args.no_stream else stream(model, settings)
    if streamed is not None:
        print(rounded(streamed))
    result = {
        "tower": settings.tower.name,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "graphs": "simulated" if settings.simulated else "cuda",
        "dtype": str(settings.dtype),
        "config": model.config.to_dict(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "seed": settings.seed,
        "options": settings.options,
        "seconds": time.perf_counter() - started,
        "calls": rows,
        "stream": streamed,
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
