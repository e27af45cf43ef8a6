"""Where a replay's time goes: kernels per replay and the time they take, per method.

    python3 benchmarks/profile_replay.py --batch 1 --json profile.json

For each benchmark model (random weights, bf16) at one batch size: eager, the hand-written
graph of the whole forward, layergraph, and layergraph with the speed options of ``VARIANTS`` and
``ADAPTER_VARIANTS`` (compiled layers or the compiled region, fused q/k/v, the patch
embedding as a product and the GELU epilogue, the attention backend; Inductor's GEMM templates
with ``--max-autotune``), or those named with ``--methods``. Each is checked against eager,
timed (median of CUDA-event timings), and profiled over a number of replays with
``torch.profiler``: kernels per replay, the sum of their durations (GPU busy time) and every
kernel with its calls and time per replay (the JSON holds them all; the console, the five
longest). With ``--compile``, torch.compile(mode="reduce-overhead") of the model is measured
the same way, after layergraph's graphs are released; it compiles for long, so the GPU suite
gives it one model per run. Latency minus busy time is the time the GPU waits between kernels
inside the graph.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import layergraph
from layergraph.bench.examples import example_model
from layergraph.reference import compiled_reduce_overhead, plain_graph
from layergraph.timing import median_ms
from layergraph.validation import first_tensor, relative_error

MODELS = ("vit_base_patch16_224", "siglip-so400m-384", "internvit-300m")

REWRITES: dict[str, Any] = {"patch_matmul": True, "fuse_gelu": "approximate"}
"""The patch embedding as one product and the MLPs' GELU in their up-projections' epilogue."""

VARIANTS: dict[str, dict[str, Any]] = {
    "layergraph": {},
    "compiled layers": {"compile_layers": True},
    "compiled region": {"compile_region": True},
    "rewrites": REWRITES,
    "rewrites, compiled region": {**REWRITES, "compile_region": True},
}
"""layergraph options timed for every model, by label."""

MAX_AUTOTUNE: dict[str, dict[str, Any]] = {
    "compiled layers, max-autotune": {"compile_layers": {"mode": "max-autotune-no-cudagraphs"}},
}
"""With ``--max-autotune``: Inductor's GEMM templates too (compiles for minutes per model)."""

_FUSED = {
    "fused qkv": {"fuse_qkv": True},
    "fused qkv, compiled layers": {"fuse_qkv": True, "compile_layers": True},
    "fused qkv, compiled region": {"fuse_qkv": True, "compile_region": True},
}
_ALL = {"fuse_qkv": True, **REWRITES, "compile_region": True}
ADAPTER_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "internvl": {
        "triton": {"attention": "triton"},
        "triton, fused qkv": {"attention": "triton", "fuse_qkv": True},
        "triton, fused qkv, compiled layers": {
            "attention": "triton",
            "fuse_qkv": True,
            "compile_layers": True,
        },
        "triton, fused qkv, compiled region": {
            "attention": "triton",
            "fuse_qkv": True,
            "compile_region": True,
        },
        **{
            f"{attention}, fused qkv, rewrites, compiled region": {**_ALL, "attention": attention}
            for attention in ("auto", "sdpa", "triton")
        },
        "fused qkv, rewrites, compiled layers": {
            **_ALL,
            "compile_region": False,
            "compile_layers": True,
        },
        "fused qkv, rewrites, compiled region, coordinate descent": {
            **_ALL,
            "compile_region": {"options": {"coordinate_descent_tuning": True}},
        },
        "fused qkv, rewrites, compiled region, max-autotune": {
            **_ALL,
            "compile_region": {"mode": "max-autotune-no-cudagraphs"},
        },
    },
    "siglip": {
        **_FUSED,
        "fused qkv, rewrites": {"fuse_qkv": True, **REWRITES},
        "fused qkv, rewrites, compiled region": _ALL,
    },
    "clip": _FUSED,
}
"""Further options timed for the models of the adapters that take them."""


def profile_replays(fn: Callable[[], Any], replays: int) -> dict[str, Any]:
    """Kernels per call of ``fn``, their summed duration, and every kernel, longest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    kernels = [
        event
        for event in prof.key_averages()
        if event.device_type == torch.autograd.DeviceType.CUDA
        and not event.key.startswith(("Memcpy", "Memset"))
    ]
    busy_us = sum(event.device_time_total for event in kernels) / replays
    by_time = [
        {
            "kernel": event.key[:160],
            "calls": event.count / replays,
            "ms": event.device_time_total / replays / 1e3,
        }
        for event in sorted(kernels, key=lambda event: event.device_time_total, reverse=True)
    ]
    return {
        "kernels_per_call": sum(event.count for event in kernels) / replays,
        "busy_ms": busy_us / 1e3,
        "kernels": by_time,
    }


def measure_model(
    name: str,
    batch: int,
    iters: int,
    replays: int,
    max_autotune: bool,
    compile: bool,
    methods: set[str] | None = None,
) -> list[dict[str, Any]]:
    """Every method for one model at one batch size (of ``methods`` only, if given), as rows.

    Eager and the hand-written graph are always measured.
    """
    example = example_model(name)
    model = example.build(torch.bfloat16, torch.device("cuda"))
    args, kwargs = example.inputs(batch, torch.bfloat16, torch.device("cuda"))
    device = torch.device("cuda")
    rows = []
    with torch.inference_mode():
        expected = first_tensor(model(*args, **kwargs))
        row = {"model": name, "method": "eager", "batch": batch}
        row["ms"] = median_ms(lambda: model(*args, **kwargs), device=device, iters=iters)
        row.update(profile_replays(lambda: model(*args, **kwargs), replays))
        rows.append(row)
        print(_line(row), flush=True)
        by_hand = plain_graph(model, *args, **kwargs)
        row = {"model": name, "method": "hand-written graph", "batch": batch}
        row["ms"] = median_ms(lambda: by_hand(*args, **kwargs), device=device, iters=iters)
        row.update(profile_replays(lambda: by_hand(*args, **kwargs), replays))
        rows.append(row)
        print(_line(row), flush=True)
        variants = {
            **VARIANTS,
            **(MAX_AUTOTUNE if max_autotune else {}),
            **ADAPTER_VARIANTS.get(example.adapter, {}),
        }
        for label, options in variants.items():
            if methods is not None and label not in methods:
                continue
            torch._dynamo.reset()
            started = time.perf_counter()
            try:
                graphed = layergraph.wrap(
                    model, adapter=example.adapter, batch_sizes=[batch], **options
                )
            except ValueError as error:  # an option this model refuses (quick GELU, say)
                print(f"{name:>22} {label:>36} skipped: {error}", flush=True)
                continue
            graphed.capture(*args, progress=False, **kwargs)
            torch.cuda.synchronize()
            row = {"model": name, "method": label, "batch": batch}
            row["setup_s"] = time.perf_counter() - started
            row["relative_error"] = relative_error(first_tensor(graphed(*args, **kwargs)), expected)
            row["ms"] = median_ms(lambda g=graphed: g(*args, **kwargs), device=device, iters=iters)
            row.update(profile_replays(lambda g=graphed: g(*args, **kwargs), replays))
            if graphed.stats.eager_total:
                row["eager_calls"] = graphed.stats.eager_total
            chosen = getattr(graphed.plan, "attention_by_key", None)
            if chosen:
                row["attention"] = sorted(set(chosen.values()))
            graphed.unwrap()
            rows.append(row)
            print(_line(row), flush=True)
        if compile:
            rows.append(
                _torch_compile_row(model, name, batch, args, kwargs, expected, iters, replays)
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _torch_compile_row(
    model: torch.nn.Module,
    name: str,
    batch: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    expected: torch.Tensor,
    iters: int,
    replays: int,
) -> dict[str, Any]:
    """torch.compile(mode="reduce-overhead") of the unwrapped model, measured last."""
    torch._dynamo.reset()
    started = time.perf_counter()
    compiled = compiled_reduce_overhead(model)
    for _ in range(3):
        got = first_tensor(compiled(*args, **kwargs))
    torch.cuda.synchronize()
    row = {"model": name, "method": "torch.compile reduce-overhead", "batch": batch}
    row["setup_s"] = time.perf_counter() - started
    row["relative_error"] = relative_error(got, expected)
    row["ms"] = median_ms(lambda: compiled(*args, **kwargs), device=got.device, iters=iters)
    row.update(profile_replays(lambda: compiled(*args, **kwargs), replays))
    return row


def _line(row: dict[str, Any]) -> str:
    error = row.get("relative_error")
    return (
        f"{row['model']:>22} {row['method']:>36} {row['ms']:8.3f} ms "
        f"{row['kernels_per_call']:6.0f} kernels {row['busy_ms']:8.3f} ms busy"
        + ("" if error is None else f"  err {error:.2e}  setup {row['setup_s']:.1f} s")
        + (f"  attention {', '.join(row['attention'])}" if "attention" in row else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--max-autotune", action="store_true", help="also time MAX_AUTOTUNE")
    parser.add_argument(
        "--compile", action="store_true", help="also torch.compile reduce-overhead, last"
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="';'-separated labels of the layergraph methods to measure (default: all)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    methods = set(args.methods.split(";")) if args.methods else None
    rows = []
    for name in args.models.split(","):
        rows += measure_model(
            name, args.batch, args.iters, args.replays, args.max_autotune, args.compile, methods
        )
        torch.cuda.empty_cache()  # the model of the last run is gone
    for row in rows:
        print(_line(row))
        for kernel in row["kernels"][:5]:
            print(f"{'':>24} {kernel['ms']:8.3f} ms x{kernel['calls']:<4.0f} {kernel['kernel']}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
