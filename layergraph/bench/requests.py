"""Streams of requests of images of mixed sizes, eager against wrapped: a VLM's time to first
token, and a native-resolution tower's calls.

A serving engine runs one prefill per request before its first token: a forward over the
whole prompt, images included, keeping the last position's logits. :func:`run_prefill` draws
a seeded stream of requests of 1 to 3 images (sizes from :data:`REQUEST_SIZES`), laid out by
the example VLM's ``prompt`` (an adapter's example model), and times each prefill.
:func:`run_image_stream` gives a tower that takes every image at its own size (an example with
``sized_inputs``) such requests as calls of their images. Each request is waited for: first
through the model as it is (eager), then through ``layergraph.wrap(model)`` twice, the first
pass observing the traffic, choosing budgets and capturing, the second the steady state. The
report holds, per pass, the 50th and 90th percentiles of the waited times, their total and the
worst relative error against eager (the last logits; the tower's pooled output where it has
one, else its first). Without a GPU it runs in float32 with simulated graphs
(:class:`~layergraph.testing.SimulatedGraphs`), so the same code path runs anywhere.

What it does not do: generate tokens past the first, batch requests together, or time the
processor's work on the host.
"""

from __future__ import annotations

import datetime
import json
import platform
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..module import wrap
from ..testing import SimulatedGraphs
from ..timing import timed_call
from ..validation import first_tensor, relative_error
from .examples import ExampleModel, example_model
from .run import versions_in_use

__all__ = [
    "REQUEST_SIZES",
    "PassTimes",
    "RequestsReport",
    "draw_requests",
    "run_image_stream",
    "run_prefill",
]

REQUEST_SIZES: tuple[tuple[int, int], ...] = (
    (448, 448),
    (448, 672),
    (672, 896),
    (768, 1024),
    (1008, 1344),
)
"""Image sizes (height, width) in pixels the requests draw from, up to about 1.4 megapixels."""

PASSES = ("eager", "layergraph_first_pass", "layergraph")
"""The passes over the stream, in the order they run."""


@dataclass
class PassTimes:
    """One pass over the stream: percentiles and total of its waited times, and its worst
    relative error against eager's answers (0 for eager itself)."""

    p50_ms: float
    p90_ms: float
    total_s: float
    error: float


@dataclass
class RequestsReport:
    """A stream of requests served eagerly and wrapped: what ran where, the stream, and each
    pass (:data:`PASSES`)."""

    kind: str
    """``"prefill"`` (:func:`run_prefill`) or ``"images"`` (:func:`run_image_stream`)."""
    model: str
    adapter: str
    device: str
    dtype: str
    graphs_kind: str
    """``"cuda"``, or ``"simulated"`` without a GPU (replays rerun the captured region)."""
    versions: dict[str, str]
    date: str
    command: str
    seed: int
    requests: int
    images: int
    prompt_tokens: int | None = None
    """The prompts' tokens, images included (a prefill)."""
    passes: dict[str, PassTimes] = field(default_factory=dict)
    graphs: int = 0
    budgets: list[int] = field(default_factory=list)
    capture_seconds: float = 0.0
    eager_calls: dict[str, int] = field(default_factory=dict)
    """Calls the wrapper served eagerly over both passes, by reason."""

    def speedup(self, percentile: str) -> float | None:
        """Eager's ``p50_ms`` or ``p90_ms`` over the steady pass's."""
        if "eager" not in self.passes or "layergraph" not in self.passes:
            return None
        return getattr(self.passes["eager"], percentile) / getattr(
            self.passes["layergraph"], percentile
        )

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["p50_speedup"] = self.speedup("p50_ms")
        record["p90_speedup"] = self.speedup("p90_ms")
        return record

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def to_markdown(self) -> str:
        """A Markdown section: the setting, then one table row per pass."""
        p50, p90 = self.speedup("p50_ms"), self.speedup("p90_ms")
        what = "time to first token" if self.kind == "prefill" else "time per request"
        prompts = "" if self.prompt_tokens is None else f", {self.prompt_tokens} prompt tokens"
        lines = [
            f"{self.model} ({self.adapter} adapter), {self.dtype}, {self.device}, {self.date}",
            "",
            f"- versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}",
            f"- command: `{self.command}`",
            f"- {self.requests} requests (seed {self.seed}), {self.images} images{prompts}; "
            "each request waited for, timed "
            + ("with CUDA events" if self.graphs_kind == "cuda" else "by the wall clock"),
            f"- graphs: {self.graphs_kind}, {self.graphs} (budgets {self.budgets}), captured "
            f"in {self.capture_seconds:.2f} s; eager calls {self.eager_calls or 'none'}",
            "",
            "| pass | p50 ms | p90 ms | total s | worst error |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, part in self.passes.items():
            lines.append(
                f"| {name} | {part.p50_ms:.2f} | {part.p90_ms:.2f} | {part.total_s:.3f} | "
                f"{part.error:.1e} |"
            )
        if p50 is not None and p90 is not None:
            lines += [
                "",
                f"{what.capitalize()}, eager over layergraph: p50 {p50:.2f}x, p90 {p90:.2f}x.",
            ]
        return "\n".join(lines) + "\n"


def draw_requests(
    counts: Sequence[int], sizes: Sequence[tuple[int, int]], seed: int
) -> list[list[tuple[int, int]]]:
    """One request per entry of ``counts``, of that many images, their sizes drawn from
    ``sizes`` reproducibly from ``seed``."""
    rng = random.Random(seed)
    return [[rng.choice(sizes) for _ in range(count)] for count in counts]


def run_prefill(
    model: str | ExampleModel,
    requests: int = 60,
    *,
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] = REQUEST_SIZES,
    dtype: torch.dtype = torch.bfloat16,
    observe_calls: int | None = None,
) -> RequestsReport:
    """``requests`` prefills of 1 to 3 images through the example VLM ``model`` (a name of
    ``layergraph bench --list-models`` whose example has a ``prompt``, or the example
    itself), eager and then wrapped (two passes); see the module's text. ``observe_calls``
    goes to ``wrap`` (``None``: its default)."""
    example = example_model(model) if isinstance(model, str) else model
    if example.prompt is None:
        raise ValueError(
            f"{example.name} is no VLM with example prompts; a prefill needs one (such as "
            f"qwen2.5-vl-3b)"
        )
    counts = random.Random(seed).choices((1, 2, 3), k=requests)
    drawn = draw_requests(counts, sizes, seed)

    def make(images: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> Any:
        return (), example.prompt(images, dtype, device)

    return _serve("prefill", example, drawn, make, _prefill, seed, dtype, observe_calls)


def run_image_stream(
    model: str | ExampleModel,
    counts: Sequence[int],
    *,
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] = REQUEST_SIZES,
    dtype: torch.dtype = torch.bfloat16,
    observe_calls: int | None = None,
) -> RequestsReport:
    """A stream of requests through the example tower ``model`` (one with ``sized_inputs``:
    it takes every image at its own size), one per entry of ``counts``, of that many images
    of sizes drawn from ``sizes``, each request one call; eager and then wrapped (two
    passes); see the module's text."""
    example = example_model(model) if isinstance(model, str) else model
    if example.sized_inputs is None:
        raise ValueError(
            f"{example.name} takes images of one size; a stream of images of mixed sizes is "
            f"for the towers that take every image at its own size"
        )
    drawn = draw_requests(counts, sizes, seed)
    return _serve(
        "images", example, drawn, example.sized_inputs, _answer, seed, dtype, observe_calls
    )


def _serve(
    kind: str,
    example: ExampleModel,
    drawn: list[list[tuple[int, int]]],
    make: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]],
    answer: Callable[..., torch.Tensor],
    seed: int,
    dtype: torch.dtype,
    observe_calls: int | None,
) -> RequestsReport:
    """The requests ``drawn`` (each a list of image sizes, ``make`` turning it into a call's
    inputs) through the example's model eagerly and then wrapped twice, each request's
    ``answer(model, args, kwargs)`` waited for and compared with eager's."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        dtype = torch.float32
    torch.manual_seed(seed)
    model = example.build(dtype, device)
    calls = [make(images, dtype, device) for images in drawn]
    report = RequestsReport(
        kind=kind,
        model=example.name,
        adapter=example.adapter,
        device=torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
        dtype=str(dtype).removeprefix("torch."),
        graphs_kind="cuda" if cuda else "simulated",
        versions=versions_in_use(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["layergraph", *sys.argv[1:]])
        if sys.argv[0].endswith("layergraph")
        else f"run_{'prefill' if kind == 'prefill' else 'image_stream'}({example.name!r}, ...)",
        seed=seed,
        requests=len(drawn),
        images=sum(len(images) for images in drawn),
    )
    if kind == "prefill":
        report.prompt_tokens = sum(kwargs["input_ids"].shape[1] for _, kwargs in calls)
    with torch.inference_mode():
        answer(model, *calls[0])  # warm-up: kernels load, caches fill
        timed = [timed_call(lambda c=call: answer(model, *c), device=device) for call in calls]
        wanted = [output.float() for output, _ in timed]
        report.passes["eager"] = _summary([ms for _, ms in timed], [0.0])
        options: dict[str, Any] = {} if observe_calls is None else {"observe_calls": observe_calls}
        graphed = wrap(model, backend=None if cuda else SimulatedGraphs(), **options)
        for name in PASSES[1:]:
            times, errors = [], []
            for call, want in zip(calls, wanted):
                output, ms = timed_call(lambda c=call: answer(graphed, *c), device=device)
                times.append(ms)
                errors.append(relative_error(output.float(), want))
            report.passes[name] = _summary(times, errors)
        stats = graphed.stats
        report.graphs = stats.graphs
        report.budgets = sorted(key.batch for key in graphed.keys)
        report.capture_seconds = stats.capture_seconds
        report.eager_calls = dict(stats.eager_calls)
        graphed.unwrap()
    return report


def _prefill(model: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward a serving engine runs before the first token: the last position's logits."""
    return model(*args, **kwargs, logits_to_keep=1, use_cache=False).logits[:, -1]


def _answer(model: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a tower's call answers: its pooled output where it has one (what a VLM reads of
    Qwen's and SigLIP2's towers), else its first tensor."""
    output = model(*args, **kwargs)
    pooled = getattr(output, "pooler_output", None)
    return pooled if isinstance(pooled, torch.Tensor) else first_tensor(output)


def _summary(times: list[float], errors: list[float]) -> PassTimes:
    """A pass's percentiles (linear between the nearest ranks) and total, and worst error."""
    cuts = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return PassTimes(
        p50_ms=statistics.median(times),
        p90_ms=cuts[8],
        total_s=sum(times) / 1e3,
        error=max(errors),
    )
