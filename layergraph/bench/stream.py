"""A stream of requests of mixed sizes, as a server meets them, served four ways.

A fixed-batch benchmark shows graphs at their best; served traffic mixes sizes (InternVL's
dynamic tiling sends 1 to 13 tiles per image), and padding a batch up to a captured size costs
real work where the GPU is already busy. :func:`run_stream` sends one stream of requests, each
one call waited for, to eager, to ``layergraph.wrap`` with its defaults (the measured policy,
:mod:`layergraph.policy`), to ``wrap`` with fixed buckets of powers of two, and to ``wrap``
with exact keys (``batch_sizes=None``, a graph per batch size), and checks every answer
against eager. Each method serves the stream twice: the first pass pays for captures, the second is
the steady state.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..graphs import GraphBackend
from ..module import wrap
from ..plugins import get_registry
from ..runner import DEFAULT_BATCH_SIZES
from ..validation import DEFAULT_TOLERANCE, first_tensor, relative_error

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
    second_pass_s: float
    """The stream again, every shape seen before: the steady state."""
    worst_error: float
    """The largest relative error of an answer against eager's, over both passes."""
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
        """The setting, then one table row per method; ratios against eager's second pass."""
        sizes = sorted(set(self.requests))
        eager = next((row for row in self.rows if row.method == "eager"), None)
        lines = [
            f"{self.model}, {self.dtype}, {self.device}: {len(self.requests)} requests of "
            f"{sizes[0]} to {sizes[-1]} images ({sum(self.requests)} in all), each one call "
            f"waited for, every answer checked against eager",
            "",
            "| method | first pass s | second pass s | vs eager (second pass) | graphs | "
            "captures | eager calls | padded calls | pool MiB | worst error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in self.rows:
            ratio = eager.second_pass_s / row.second_pass_s if eager else None
            pool = None if row.pool_bytes is None else row.pool_bytes / 2**20
            lines.append(
                f"| {row.method} | {row.first_pass_s:.3f} | {row.second_pass_s:.3f} | "
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
) -> StreamReport:
    """Serve ``requests`` (images per request) with eager, default ``wrap``, fixed buckets of
    powers of two (padding up to 1, 2, 4, 8, 16, 32) and exact keys.

    Without a GPU only eager is served (in float32), unless ``backend`` supplies graphs (the
    tests' simulated ones). ``tuned``, ``wrap`` options such as ``compile_region=True``, adds
    a row for default ``wrap`` with them. Raises ``AssertionError`` if an answer differs from
    eager's beyond the dtype's tolerance.
    """
    example = get_registry().example_model(model_name)
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
    with torch.inference_mode():
        expected = [first_tensor(model(*args, **kwargs)) for args, kwargs in calls]
        report.rows.append(_serve("eager", model, calls, expected, device))
        if not cuda and backend is None:
            return report
        methods: list[tuple[str, dict[str, Any]]] = [
            ("layergraph", {}),
            ("powers of two", {"batch_sizes": DEFAULT_BATCH_SIZES}),
            ("exact keys", {"batch_sizes": None}),
        ]
        if tuned:
            methods.append(("layergraph tuned", tuned))
        for method, options in methods:
            graphed = wrap(model, adapter=example.adapter, backend=backend, **options)
            row = _serve(method, graphed, calls, expected, device)
            stats = graphed.stats
            report.rows.append(
                replace(
                    row,
                    graphs=stats.graphs,
                    captures=stats.captures,
                    eager_calls=stats.eager_total,
                    padded_calls=stats.padded_calls,
                    pool_bytes=stats.pool_bytes,
                    served=[(batch, way, n) for (batch, way), n in sorted(stats.served.items())],
                    costs={batch: str(costs) for batch, costs in stats.costs.items()},
                )
            )
            graphed.unwrap()
    return report


def _serve(
    method: str,
    model: Callable[..., Any],
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
    expected: list[torch.Tensor],
    device: torch.device,
) -> StreamRow:
    """Both passes of the stream through ``model``, each call waited for and timed on its
    own; answers are checked off the clock."""
    limit = DEFAULT_TOLERANCE.get(expected[0].dtype, 1e-4)
    passes, worst = [], 0.0
    for _ in range(2):
        elapsed = 0.0
        for (args, kwargs), want in zip(calls, expected):
            started = time.perf_counter()
            got = first_tensor(model(*args, **kwargs))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed += time.perf_counter() - started
            worst = max(worst, relative_error(got, want))
        passes.append(elapsed)
    assert worst <= limit, f"{method}: an answer differs from eager by {worst:.3g} > {limit}"
    return StreamRow(method, passes[0], passes[1], worst)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)
