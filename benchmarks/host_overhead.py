"""The wrapper's own host time per call, on the CPU, with replays that cost nothing.

A 24-layer CLIP ViT-L tower (392 parameter and buffer tensors) is wrapped with a graph
backend whose replay does nothing; images are 28x28 (5 tokens), so the input copy and the
output clones, which are asynchronous launches on a GPU, cost next to nothing here either.
What remains is the wrapper's Python: the guards, the call's key, the lookup, the output's
rebuilding. ``--always-read`` makes the parameter guard read every address on each call, as it
did before moves were counted where they happen.

    python3 benchmarks/host_overhead.py
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--always-read", action="store_true")
    options = parser.parse_args()
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
