"""Time to first token of a transformers VLM on a stream of requests, eager against wrapped.

    python3 benchmarks/vlm_prefill.py --json prefill.json      # a GPU: Qwen2.5-VL-3B-sized, bf16
    python3 benchmarks/vlm_prefill.py --tiny                   # the same code path, tiny, CPU

A Qwen2.5-VL VLM (the 3B model's configuration: a 32-layer vision tower of 1280, a 36-layer
language model of 2048; random weights, nothing downloaded) is given a seeded stream of
requests, each a short prompt around 1 to 3 images of the sizes in :data:`SIZES` (up to about
1.4 megapixels), as its processor lays them out: one image token per merged patch, between the
vision start and end tokens. Each request is the prefill a serving engine runs before the first
token: one forward over the whole prompt that keeps the last position's logits
(``logits_to_keep=1``), waited for. The stream runs through the model as it is (eager) and then
through ``layergraph.wrap(vlm)`` (the tower graphed in place, the language model as it is),
twice: the first pass observes the traffic, chooses budgets and captures; the second is the
steady state (with the default 60 requests, the first pass's first 32 calls run eagerly
while the wrapper observes them). Reported per method: the p50 and p90 of the time to first
token, the total, and the worst relative error of the last logits against eager's. ``--tiny``
builds a small VLM in float32 that runs on the CPU with simulated graphs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

SIZES = ((448, 448), (672, 448), (896, 672), (1024, 768), (1344, 1008))
"""Image sizes (width, height) the requests draw from."""
TINY_SIZES = ((56, 56), (112, 56), (112, 112), (168, 112), (224, 168))
PROMPT_TOKENS = 32
"""Text tokens around a request's images."""
IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653
"""Qwen2.5-VL's image, video, vision-start and vision-end token ids."""


@dataclass(frozen=True)
class Settings:
    """How the run measures."""

    device: torch.device
    dtype: torch.dtype
    requests: int
    seed: int
    sizes: tuple[tuple[int, int], ...]
    observe_calls: int | None = None
    """Calls the wrapper observes before choosing budgets (``None``: its default)."""

    @property
    def simulated(self) -> bool:
        """Whether graphs are simulated (no GPU)."""
        return self.device.type != "cuda"


def qwen2_5_vl_config(tiny: bool) -> transformers.Qwen2_5_VLConfig:
    """Qwen2.5-VL-3B's configuration, or a small one of the same shape for ``tiny``."""
    vision = dict(
        depth=32,
        hidden_size=1280,
        num_heads=16,
        intermediate_size=3420,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        out_hidden_size=2048,
        spatial_merge_size=2,
        patch_size=14,
        temporal_patch_size=2,
    )
    text = dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
    )
    if tiny:
        vision.update(
            depth=4,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=32,
            window_size=56,
            fullatt_block_indexes=[1, 3],
        )
        text.update(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]),
        )
    return transformers.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def build(tiny: bool, settings: Settings) -> nn.Module:
    """The VLM with random weights, in ``settings``' dtype and device, for inference."""
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        model = transformers.Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config(tiny))
    return model.to(settings.dtype).eval()


def request(model: nn.Module, rng: random.Random, settings: Settings) -> dict[str, torch.Tensor]:
    """One request: a prompt of :data:`PROMPT_TOKENS` text tokens around 1 to 3 images, with
    their patches and grids, as Qwen2.5-VL's processor makes them."""
    vision = model.config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    factor = patch * merge
    grids, ids = [], []
    for _ in range(rng.randint(1, 3)):
        width, height = rng.choice(settings.sizes)
        rows, columns = (
            max(factor, round(side / factor) * factor) // patch for side in (height, width)
        )
        grids.append((1, rows, columns))
        ids += [START, *[IMAGE] * (rows * columns // merge**2), END]
    text = [rng.randrange(1000, 100000) for _ in range(PROMPT_TOKENS)]
    prompt = text[: PROMPT_TOKENS // 2] + ids + text[PROMPT_TOKENS // 2 :]
    features = vision.in_channels * vision.temporal_patch_size * patch**2
    tokens = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 31))
    pixels = torch.randn(tokens, features, generator=generator)
    return {
        "input_ids": torch.tensor([prompt], device=settings.device),
        "pixel_values": pixels.to(settings.device, settings.dtype),
        "image_grid_thw": torch.tensor(grids, device=settings.device),
    }


def prefill(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The forward a serving engine runs before the first token: the last position's logits."""
    return model(**inputs, logits_to_keep=1, use_cache=False).logits[:, -1]


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """One call of ``fn``, waited for: its output and milliseconds (CUDA events on a GPU)."""
    if device.type != "cuda":
        started = time.perf_counter()
        output = fn()
        return output, (time.perf_counter() - started) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    output = fn()
    end.record()
    end.synchronize()
    return output, start.elapsed_time(end)


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile of ``values`` (linear between the nearest ranks)."""
    return statistics.quantiles(values, n=100, method="inclusive")[round(share * 100) - 1]


def summary(times: list[float], errors: list[float]) -> dict[str, float]:
    """p50, p90 and total of a pass's times to first token (ms), and its worst error."""
    return {
        "p50_ms": percentile(times, 0.5),
        "p90_ms": percentile(times, 0.9),
        "total_s": sum(times) / 1e3,
        "error": max(errors, default=0.0),
    }


def run(model: nn.Module, settings: Settings) -> dict[str, Any]:
    """The stream through eager and through the wrapped VLM (two passes)."""
    rng = random.Random(settings.seed)
    requests = [request(model, rng, settings) for _ in range(settings.requests)]
    result: dict[str, Any] = {
        "requests": len(requests),
        "images": sum(len(r["image_grid_thw"]) for r in requests),
        "prompt_tokens": sum(r["input_ids"].shape[1] for r in requests),
        "vision_tokens": sum(r["pixel_values"].shape[0] for r in requests),
    }
    with torch.inference_mode():
        prefill(model, requests[0])  # warm-up: kernels load, caches fill
        wanted, times = [], []
        for inputs in requests:
            logits, ms = timed(lambda i=inputs: prefill(model, i), settings.device)
            wanted.append(logits.float())
            times.append(ms)
        result["eager"] = summary(times, [])
        backend = SimulatedGraphs() if settings.simulated else None
        options = (
            {} if settings.observe_calls is None else {"observe_calls": settings.observe_calls}
        )
        graphed = layergraph.wrap(model, backend=backend, **options)
        for name in ("layergraph_first_pass", "layergraph"):
            times, errors = [], []
            for inputs, want in zip(requests, wanted):
                logits, ms = timed(lambda i=inputs: prefill(graphed, i), settings.device)
                times.append(ms)
                errors.append(relative_error(logits.float(), want))
            result[name] = summary(times, errors)
        stats = graphed.stats
        result.update(
            graphs=stats.graphs,
            budgets=sorted(key.batch for key in graphed.keys),
            capture_s=stats.capture_seconds,
            eager_calls=dict(stats.eager_calls),
        )
        graphed.unwrap()
    steady, eager = result["layergraph"], result["eager"]
    result["p50_speedup"] = eager["p50_ms"] / steady["p50_ms"]
    result["p90_speedup"] = eager["p90_ms"] / steady["p90_ms"]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument("--tiny", action="store_true", help="a small VLM in float32")
    parser.add_argument("--requests", type=int, default=None, help="stream length (60; 12 tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--observe-calls",
        type=int,
        default=None,
        help="calls observed before budgets are chosen (the wrapper's default; 8 tiny)",
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.tiny and not cuda:
        parser.error("the Qwen2.5-VL-3B-sized VLM needs a CUDA GPU; --tiny runs anywhere")
    settings = Settings(
        device=torch.device("cuda" if cuda else "cpu"),
        dtype=torch.float32 if args.tiny else torch.bfloat16,
        requests=args.requests or (12 if args.tiny else 60),
        seed=args.seed,
        sizes=TINY_SIZES if args.tiny else SIZES,
        observe_calls=args.observe_calls if args.observe_calls is not None or not args.tiny else 8,
    )
    model = build(args.tiny, settings)
    started = time.perf_counter()
    result = run(model, settings)
    result.update(
        model="qwen2.5-vl-3b" if not args.tiny else "qwen2.5-vl-tiny",
        device=torch.cuda.get_device_name() if cuda else "cpu",
        graphs_kind="simulated" if settings.simulated else "cuda",
        dtype=str(settings.dtype),
        versions={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        seed=args.seed,
        seconds=time.perf_counter() - started,
    )
    for name in ("eager", "layergraph_first_pass", "layergraph"):
        part = result[name]
        print(
            f"{name:>22}: p50 {part['p50_ms']:.2f} ms, p90 {part['p90_ms']:.2f} ms, "
            f"total {part['total_s']:.3f} s, error {part['error']:.1e}"
        )
    print(
        f"time to first token, eager over layergraph: p50 {result['p50_speedup']:.2f}x, "
        f"p90 {result['p90_speedup']:.2f}x; {result['graphs']} graphs, budgets "
        f"{result['budgets']}, eager calls {result['eager_calls']}"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
