"""The plain-graph reference: the whole forward captured by hand with ``torch.cuda.graph``.

This is what a user would write without layergraph, for one fixed input shape: a static input,
a side-stream warm-up, one capture, and replays that copy the new input in. Benchmarks and the
demo time it beside layergraph; it is not used to serve calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["plain_graph"]


def plain_graph(
    model: nn.Module, example: torch.Tensor, warmup_runs: int = 3
) -> Callable[[torch.Tensor], Any]:
    """Capture ``model(example)`` by hand; return ``run(x)`` that copies ``x`` in and replays.

    ``run`` returns the graph's static output, overwritten by the next replay.
    """
    static_input = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            model(static_input)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = model(static_input)

    def run(x: torch.Tensor) -> Any:
        static_input.copy_(x)
        graph.replay()
        return static_output

    return run
