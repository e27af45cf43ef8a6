"""The references layergraph is measured against, as a user would write them by hand.

- :func:`plain_graph`: the whole forward captured once with ``torch.cuda.graph`` for one fixed
  input shape (static inputs, a side-stream warm-up, one capture, replays that copy new inputs
  in);
- :func:`compiled_reduce_overhead`: ``torch.compile(mode="reduce-overhead")``.

Benchmarks and the demo time them beside layergraph; they are not used to serve calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["compiled_reduce_overhead", "plain_graph"]


def plain_graph(
    model: nn.Module, *args: Any, warmup_runs: int = 3, **kwargs: Any
) -> Callable[..., Any]:
    """Capture ``model(*args, **kwargs)`` by hand; return ``run`` taking new arguments alike.

    ``run`` copies the new tensors into the static ones, replays, and returns the graph's
    static output, overwritten by the next replay.
    """
    static_args, static_kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            model(*static_args, **static_kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = model(*static_args, **static_kwargs)
    static_leaves = pytree.tree_leaves((static_args, static_kwargs))

    def run(*new_args: Any, **new_kwargs: Any) -> Any:
        for static, new in zip(static_leaves, pytree.tree_leaves((new_args, new_kwargs))):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
        graph.replay()
        return static_output

    return run


def compiled_reduce_overhead(model: nn.Module) -> Callable[..., Any]:
    """``torch.compile(model, mode="reduce-overhead")``: Inductor kernels in CUDA graphs.

    It compiles on the first calls of each new shape, which takes seconds to tens of seconds.
    """
    return torch.compile(model, mode="reduce-overhead", dynamic=False)
