"""The packed towers' streams replayed through layergraph's runner on the CPU: how many graphs
the learnt token budgets capture, how often they are planned, how much they pad, and the pool
their graphs share.

    python3 benchmarks/budget_replay.py                     # Qwen2.5-VL-7B's stream
    python3 benchmarks/budget_replay.py --towers qwen3-vl-8b --json replay.json

What the GPU run of ``packed_towers.py`` reports as captures, replans, budgets and pool comes
from layergraph's runner deciding what to capture; none of it needs a GPU or the tower. Here a
stand-in plan (:class:`TokenPlan`) receives, in order, the calls ``packed_towers.py`` makes on
its stream (its 100 requests twice: the first pass and the second), each a tensor of the
call's tokens with its images' token counts; the runner packs, plans, splits, captures and
replays them as it does the tower's, through :class:`~layergraph.testing.SimulatedGraphs`. The
stand-in's outputs per token are the tower's in proportion (Qwen2.5-VL-7B's last hidden state
of 1280 and merged features of 3584 per four tokens), and the simulated pool gives each
capture a working set of :data:`WORKING_SET` blocks the size of its outputs (the tower's
intermediates: 928 MiB reserved for 64 MiB of outputs at 15,360 tokens on an H200), so that
the pool's size against the top budget's graph captured alone is the pool model's. Every
graph pays (its replay is timed faster than the eager call), as the tower's do on the H200.

What this does not measure: time. ``captured_tokens`` (the sum of the budgets of every
capture) stands in for capture time, which on a GPU grows with the budget's tokens. Nothing
here runs a tower: ``packed_towers.py`` measures speed and checks answers on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import qwen_towers
import torch
from qwen_towers import frame_rows
from torch import nn

from layergraph.adapter import CapturePlan
from layergraph.packing import PackedCall, Packing, split_ranges
from layergraph.runner import GraphRunner, RunnerOptions
from layergraph.testing import SimulatedGraphs

SIZES = ((224, 224), (448, 448), (672, 448), (896, 896), (1344, 1008))
"""The image sizes of ``packed_towers.py``'s stream."""
WORKING_SET = 13
"""A capture's intermediates, in blocks of its outputs' size (Qwen2.5-VL-7B's tower on an
H200: a pool of 928 MiB for 64 MiB of outputs)."""
HIDDEN, MERGED = 10, 28
"""Floats per token of the stand-in's last hidden state, and per merged group of four tokens
of its merged features: Qwen2.5-VL-7B's 1280 and 3584 in proportion."""
BUDGET_STEP, MAX_TOKENS = 64, 16384
"""The qwen2_vl adapter's defaults: learnt budgets are multiples of 64 tokens, at most 16384."""


class TokenPlan(CapturePlan, Packing):
    """A packed plan whose calls are ``region(tokens, sizes=...)``: ``tokens`` one row per
    token, ``sizes`` the token count of each image. Its outputs are a last hidden state of
    :data:`HIDDEN` floats per token and merged features of :data:`MERGED` floats per four
    tokens, computed from the tokens so that a replay that read stale buffers would differ.
    It serves the replay alone: it computes nothing a tower does."""

    budget_unit = 4
    budget_step = BUDGET_STEP
    largest_budget = MAX_TOKENS

    def __init__(self) -> None:
        self.owner = nn.Linear(1, 1).eval()
        self.packing = self
        self.allocated: list[int] = []
        """The budget of every graph's buffers, in order: one per capture."""

    def region(self, tokens: torch.Tensor, sizes: tuple[int, ...] = ()) -> Any:
        hidden = tokens.expand(-1, HIDDEN) * 2
        merged = tokens.reshape(-1, 4).sum(1, keepdim=True).expand(-1, MERGED) * 1
        return hidden, merged

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedCall:
        tokens = args[0]
        return PackedCall(
            args, kwargs, tokens.shape[0], None, (tokens,), parts=tuple(kwargs["sizes"])
        )

    def split(self, call: PackedCall, budget: int) -> list[PackedCall]:
        pieces, start = [], 0
        for indices in split_ranges(call.parts, budget):
            sizes = tuple(call.parts[i] for i in indices)
            rows = call.args[0][start : start + sum(sizes)]
            start += sum(sizes)
            pieces.append(self.pack((rows,), {"sizes": sizes}))
        return pieces

    def allocate(self, budget: int, call: PackedCall) -> torch.Tensor:
        self.allocated.append(budget)
        return torch.zeros(budget, 1)

    def load(self, buffers: torch.Tensor, call: PackedCall) -> None:
        buffers[: call.size].copy_(call.args[0])
        buffers[call.size :].zero_()

    def arguments(self, buffers: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (buffers,), {}

    def cut(self, output: Any, call: PackedCall, budget: int) -> Any:
        hidden, merged = output
        return hidden[: call.size], merged[: call.size // 4]

    def sequence_of(self, call: Any) -> Hashable:
        return None


def stream_calls(tower: qwen_towers.Tower, requests: int, seed: int) -> list[tuple[int, ...]]:
    """The image token counts of each call of ``tower``'s stream in ``packed_towers.py``."""
    config = tower.config()
    grids = qwen_towers.stream_requests(config, requests, SIZES, seed)
    if tower.video_rows:
        grids = [frame_rows(entries) for entries in grids]
    return [tuple(t * h * w for t, h, w in entries) for entries in grids]


def runner(budgets: Sequence[int] | None = None) -> GraphRunner:
    """A runner of :class:`TokenPlan` on simulated graphs: learnt budgets, or ``budgets``."""
    backend = SimulatedGraphs(
        eager_ms=lambda tokens: 5.0 + tokens / 1000,
        replay_ms=lambda tokens: 1.0 + tokens / 1000,
        working_set=WORKING_SET,
    )
    options = RunnerOptions(batch_sizes="auto" if budgets is None else list(budgets))
    return GraphRunner(TokenPlan(), options, backend)


def replay(calls: Sequence[tuple[int, ...]]) -> dict[str, Any]:
    """``calls`` twice (the benchmark's first pass and second) through a runner with learnt
    budgets: what it captured and planned, the padding of each pass's calls served by graphs,
    its pool against its top budget's graph captured alone, and the largest difference of an
    answer from the stand-in's eager one."""
    served = runner()
    worst = 0.0
    passes = []
    with torch.inference_mode():
        for _ in range(2):
            before = served.stats().served
            for index, sizes in enumerate(calls):
                tokens = torch.arange(sum(sizes), dtype=torch.float32).unsqueeze(1) + index
                got = served(tokens, sizes=sizes)
                want = served.plan.region(tokens)
                worst = max(worst, *(float((g - w).abs().max()) for g, w in zip(got, want)))
            passes.append(padding_of(served.stats().served - before))
    stats = served.stats()
    top = stats.budgets[-1] if stats.budgets else None
    alone = pool_alone(top) if top is not None else None
    return {
        "calls": 2 * len(calls),
        "captures": stats.captures,
        "graphs": stats.graphs,
        "replans": stats.replans,
        "budgets": list(stats.budgets),
        "captured_budgets": served.plan.allocated,
        "captured_tokens": sum(served.plan.allocated),
        "eager_calls": dict(stats.eager_calls),
        "padding_first_pass": passes[0],
        "padding_second_pass": passes[1],
        "pool_vs_top_alone": stats.pool_bytes / alone if alone else None,
        "largest_difference": worst,
    }


def padding_of(served: Counter[tuple[int, str]]) -> float:
    """Padding tokens over real tokens of the calls ``served`` (by tokens and way) says a graph
    served: its own budget (``"graph"``) or a larger one (``"padded to N"``)."""
    padded = real = 0
    for (tokens, way), count in served.items():
        if way == "graph" or way.startswith("padded to "):
            budget = tokens if way == "graph" else int(way.removeprefix("padded to "))
            padded += count * (budget - tokens)
            real += count * tokens
    return padded / real if real else 0.0


def pool_alone(budget: int) -> int:
    """The pool of ``budget``'s graph captured alone (given as the only budget)."""
    alone = runner([budget])
    with torch.inference_mode():
        alone(torch.zeros(budget, 1), sizes=(budget,))
    return alone.stats().pool_bytes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", default="qwen2.5-vl-7b", help="comma-separated names")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args(argv)
    names = args.towers.split(",")
    result = {
        tower.name: replay(stream_calls(tower, args.requests, args.seed))
        for tower in qwen_towers.towers(tiny=False)
        if tower.name in names
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            file.write(text + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
