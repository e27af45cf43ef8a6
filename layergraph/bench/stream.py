"""A stream of requests of mixed sizes, as a server meets them, served four ways.

A fixed-batch benchmark shows graphs at their best; served traffic mixes sizes (InternVL's
dynamic tiling sends 1 to 13 tiles per image), and padding a batch up to a captured size costs
real work where the GPU is already busy. :func:`run_stream` sends one stream of requests, each
one call waited for, to eager, to ``layergraph.wrap`` with its defaults (the measured policy,
:mod:`layergraph.serving.policy`), to ``wrap`` with fixed buckets of powers of two, and to ``wrap``
with exact keys (``batch_sizes=None``, a graph per batch size), and checks every answer
against eager.

Each method serves its own copy of the model (same weights), so that all of them can be held at
once. Each serves the stream once to capture what it captures (the first pass), then the
methods take turns, a whole pass each, ``passes`` times, the order rotating from one round to
the next; a method's steady time is the median of its turns. Taking turns spreads over every
method alike whatever drifts during the run (clocks, other work on the host), which a method
timed after another would have to itself.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..graphs import GraphBackend
from ..module import wrap
from ..runner import DEFAULT_BATCH_SIZES
from ..validation import DEFAULT_TOLERANCE, first_tensor, relative_error
from .examples import example_model

__all__ = ["StreamReport", "StreamRow", "parse_stream", "run_stream"]


def parse_stream(text: str, seed: int = 0) -> list[int]:
    """Request sizes from ``"COUNT:LOW-HIGH"``: ``COUNT`` sizes drawn uniformly from ``LOW`` to
    ``HIGH`` inclusive, reproducibly from ``seed``. Raises ``ValueError`` naming the format."""
    try:
        count, sizes = text.split(":")
        low, high = (int(part) for part in sizes.split("-"))
        count_value = int(count)
    except ValueError:
        raise ValueError(f"stream {text!r}: expected COUNT:LOW-HIGH, e.g. 120:1-13") from None
    if count_value < 1 or not 1 <= low <= high:
        raise ValueError(f"stream {text!r}: need COUNT >= 1 and 1 <= LOW <= HIGH")
    draw = random.Random(seed)
    return [draw.randint(low, high) for _ in range(count_value)]


@dataclass
class StreamRow:
    """One method over the whole stream."""

    method: str
    first_pass_s: float
    """The stream's first pass, captures included."""
    steady_s: float
    """The median of the later passes, every shape seen before: the steady state."""
    steady_passes: list[float]
    """Each later pass, in the order they ran."""
    worst_error: float
    """The largest relative error of an answer against eager's, over every pass."""
    graphs: int | None = None
    captures: int | None = None
    eager_calls: int | None = None
    padded_calls: int | None = None
    pool_bytes: int | None = None
    served: list[tuple[int, str, int]] | None = None
    """Calls by batch size and the way each was served (``GraphStats.served``)."""
    costs: dict[int, str] | None = None
    """What the runner measured, by batch size (``GraphStats.costs``)."""


@dataclass
class StreamReport:
    """A stream served by each method: the requests, the setting, one row per method."""

    model: str
    device: str
    dtype: str
    requests: list[int]
    rows: list[StreamRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        """The setting, then one table row per method; ratios against eager's steady time."""
        sizes = sorted(set(self.requests))
        eager = next((row for row in self.rows if row.method == "eager"), None)
        lines = [
            f"{self.model}, {self.dtype}, {self.device}: {len(self.requests)} requests of "
            f"{sizes[0]} to {sizes[-1]} images ({sum(self.requests)} in all), each one call "
            f"waited for, every answer checked against eager; steady: the median of "
            f"{len(eager.steady_passes) if eager else 0} passes, the methods taking turns",
            "",
            "| method | first pass s | steady s | vs eager (steady) | graphs | "
            "captures | eager calls | padded calls | pool MiB | worst error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in self.rows:
            ratio = eager.steady_s / row.steady_s if eager else None
            pool = None if row.pool_bytes is None else row.pool_bytes / 2**20
            lines.append(
                f"| {row.method} | {row.first_pass_s:.3f} | {row.steady_s:.3f} | "
                f"{'-' if ratio is None else f'{ratio:.3f}x'} | {_cell(row.graphs)} | "
                f"{_cell(row.captures)} | {_cell(row.eager_calls)} | "
                f"{_cell(row.padded_calls)} | {'-' if pool is None else f'{pool:.0f}'} | "
                f"{row.worst_error:.2e} |"
            )
        return "\n".join(lines) + "\n"


def run_stream(
    model_name: str,
    requests: Sequence[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    backend: GraphBackend | None = None,
    tuned: dict[str, Any] | None = None,
    passes: int = 5,
) -> StreamReport:
    """Serve ``requests`` (images per request) with eager, default ``wrap``, fixed buckets of
    powers of two (padding up to 1, 2, 4, 8, 16, 32) and exact keys.

    Without a GPU only eager is served (in float32), unless ``backend`` supplies graphs (the
    tests' simulated ones). ``tuned``, ``wrap`` options such as ``compile_region=True``, adds
    a row for default ``wrap`` with them. ``passes`` is the number of steady passes per method
    (at least 1). Raises ``AssertionError`` if an answer differs from eager's beyond the
    dtype's tolerance.
    """
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    example = example_model(model_name)
    if example.sized_inputs is not None:
        raise ValueError(
            f"{example.name} takes every image at its own size: a stream of batches of one "
            f"size and its bucket and exact-key methods do not describe its traffic "
            f"(layergraph.bench.requests.run_image_stream serves it images of mixed sizes)"
        )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        dtype = torch.float32
    model = example.build(dtype, device)
    calls = [example.inputs(batch, dtype, device) for batch in requests]
    report = StreamReport(
        model=example.name,
        device=torch.cuda.get_device_name() if cuda else "CPU",
        dtype=str(dtype).removeprefix("torch."),
        requests=list(requests),
    )
    methods: list[tuple[str, dict[str, Any]]] = []
    if cuda or backend is not None:
        methods = [
            ("layergraph", {}),
            ("powers of two", {"batch_sizes": DEFAULT_BATCH_SIZES}),
            ("exact keys", {"batch_sizes": None}),
        ]
        if tuned:
            methods.append(("layergraph tuned", tuned))
    with torch.inference_mode():
        expected = [first_tensor(model(*args, **kwargs)) for args, kwargs in calls]
        served: list[_Served] = [_Served("eager", model, calls, expected, device)]
        for method, options in methods:
            graphed = wrap(
                copy.deepcopy(model), adapter=example.adapter, backend=backend, **options
            )
            served.append(_Served(method, graphed, calls, expected, device))
        for method in served:
            method.first = method.serve()
        for turn in range(passes):
            shift = turn % len(served)
            for method in served[shift:] + served[:shift]:
                method.steady.append(method.serve())
        for method in served:
            report.rows.append(method.row())
            if method.name != "eager":
                method.model.unwrap()
    return report


class _Served:
    """One method serving the stream: its model, and the seconds of each pass so far."""

    def __init__(
        self,
        name: str,
        model: Any,
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
        expected: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        self.name, self.model, self.calls, self.expected, self.device = (
            name,
            model,
            calls,
            expected,
            device,
        )
        self.limit = DEFAULT_TOLERANCE.get(expected[0].dtype, 1e-4)
        self.first = 0.0
        self.steady: list[float] = []
        self.worst = 0.0

    def serve(self) -> float:
        """One pass of the stream, each call waited for and timed on its own; answers are
        checked off the clock."""
        elapsed = 0.0
        for (args, kwargs), want in zip(self.calls, self.expected):
            started = time.perf_counter()
            got = first_tensor(self.model(*args, **kwargs))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed += time.perf_counter() - started
            self.worst = max(self.worst, relative_error(got, want))
        assert self.worst <= self.limit, (
            f"{self.name}: an answer differs from eager by {self.worst:.3g} > {self.limit}"
        )
        return elapsed

    def row(self) -> StreamRow:
        """This method's row, with the wrapper's statistics where it is one."""
        row = StreamRow(
            self.name, self.first, statistics.median(self.steady), list(self.steady), self.worst
        )
        if self.name == "eager":
            return row
        stats = self.model.stats
        return replace(
            row,
            graphs=stats.graphs,
            captures=stats.captures,
            eager_calls=stats.eager_total,
            padded_calls=stats.padded_calls,
            pool_bytes=stats.pool_bytes,
            served=[(batch, way, n) for (batch, way), n in sorted(stats.served.items())],
            costs={batch: str(costs) for batch, costs in stats.costs.items()},
        )


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)
