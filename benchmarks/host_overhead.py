"""The wrapper's own host time per call, on the CPU, with replays that cost nothing.

A 24-layer CLIP ViT-L tower (392 parameter and buffer tensors) is wrapped with a graph
backend whose replay does nothing; images are 28x28 (5 tokens), so the input copy and the
output clones, which are asynchronous launches on a GPU, cost next to nothing here either.
What remains is the wrapper's Python: the guards, the call's key, the lookup, the output's
rebuilding. ``--always-read`` makes the parameter guard read every address on each call, as it
did before moves were counted where they happen.

``--packed repeated`` or ``--packed mixed`` times a packed call instead: a 32-layer tower of
Qwen2.5-VL's shape (windows of 112 pixels, full attention every eighth layer; narrow layers,
which free replays make irrelevant) under one token budget, called with the same two images
on every call (``repeated``) or with two images drawn from six grids on each call (``mixed``,
the same draws in every run). What remains is reading the grids, the host metadata (window
order, positions, boundaries), loading the budget's buffers and the output's rebuilding.

PyTorch runs on one thread here: the copies are launches on a GPU, and on a busy CPU threads
make them cost more than everything else.

    python3 benchmarks/host_overhead.py
    python3 benchmarks/host_overhead.py --packed repeated
    python3 benchmarks/host_overhead.py --packed mixed
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import layergraph
import layergraph.guards
from layergraph.testing import SimulatedGraphs


class FreeReplays(SimulatedGraphs):
    """Simulated graphs whose replay does nothing at all."""

    def replay(self, graph: object) -> None:
        self.replays += 1


MIXED_GRIDS = ((4, 4), (4, 8), (8, 4), (8, 8), (4, 12), (12, 4))
"""The patch grids (rows, columns) of ``--packed mixed``, small, so that the input copy, which
is an asynchronous launch on a GPU, costs next to nothing here too; at most 128 tokens for
two."""


def packed_call_times(calls: int, mixed: bool) -> list[float]:
    """Host seconds of each of ``calls`` packed calls of a Qwen2.5-VL-shaped tower."""
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=32,
        hidden_size=64,
        num_heads=2,
        intermediate_size=128,
        out_hidden_size=64,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        spatial_merge_size=2,
        patch_size=14,
        temporal_patch_size=2,
    )
    tower = (
        transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(
            config
        ).eval()
    )
    graphed = layergraph.wrap(
        tower, backend=FreeReplays(), observe_calls=0, max_tokens=128, budget_step=128
    )
    features = 3 * 2 * 14 * 14
    draws = torch.Generator().manual_seed(0)
    calls_inputs = []
    for _ in range(calls + 200):
        picks = torch.randint(len(MIXED_GRIDS), (2,), generator=draws).tolist() if mixed else [0, 1]
        grid = torch.tensor([[1, *MIXED_GRIDS[pick]] for pick in picks])
        calls_inputs.append((torch.randn(int(grid.prod(1).sum()), features), grid))
    times = []
    with torch.inference_mode():
        for call, (pixels, grid) in enumerate(calls_inputs):
            started = time.perf_counter()
            graphed(pixels, grid_thw=grid)
            if call >= 200:
                times.append(time.perf_counter() - started)
    stats = graphed.stats
    assert stats.replays == calls + 200 and stats.eager_total == 0, stats
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--always-read", action="store_true")
    parser.add_argument("--packed", choices=("repeated", "mixed"), default=None)
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.packed is not None:
        times = packed_call_times(options.calls, options.packed == "mixed")
        print(
            f"host time per packed call ({options.packed} grids): median "
            f"{statistics.median(times) * 1e6:.1f} us, lowest {min(times) * 1e6:.1f} us, over "
            f"{options.calls} calls"
        )
        return
    config = transformers.CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=28,
        patch_size=14,
    )
    model = transformers.CLIPVisionModel(config).eval()
    graphed = layergraph.wrap(model, backend=FreeReplays(), batch_sizes=[1])
    pixels = torch.randn(1, 3, 28, 28)
    times = []
    with torch.inference_mode():
        for call in range(options.calls + 500):
            if options.always_read:
                layergraph.guards._moves += 1
            started = time.perf_counter()
            graphed(pixel_values=pixels)
            if call >= 500:
                times.append(time.perf_counter() - started)
    assert graphed.stats.replays == options.calls + 500 and graphed.stats.eager_total == 0
    print(
        f"host time per call: median {statistics.median(times) * 1e6:.1f} us, "
        f"lowest {min(times) * 1e6:.1f} us, over {options.calls} calls "
        f"({'every address read' if options.always_read else 'moves counted'})"
    )


if __name__ == "__main__":
    main()
