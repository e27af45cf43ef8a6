"""Time to first token of a VLM on a stream of requests, eager against wrapped.

A serving engine runs one prefill per request before its first token: a forward over the
whole prompt, images included, keeping the last position's logits. :func:`run_prefill`
draws a seeded stream of requests of 1 to 3 images (sizes from :data:`PREFILL_SIZES`), laid
out by the example VLM's ``prompt`` (an adapter's example model), and times each prefill with
a wait for its result: first through the VLM as it is (eager), then through
``layergraph.wrap(vlm)`` twice, the first pass observing the traffic, choosing budgets and
capturing, the second the steady state. It reports, per pass, the 50th and 90th percentiles
of the times to first token, their total and the worst relative error of the last logits
against eager's. Without a GPU it runs in float32 with simulated graphs
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
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..adapter import ExampleModel
from ..module import wrap
from ..plugins import get_registry
from ..testing import SimulatedGraphs
from ..validation import relative_error
from .run import versions_in_use

__all__ = ["PREFILL_SIZES", "PrefillPass", "PrefillReport", "draw_requests", "run_prefill"]

PREFILL_SIZES: tuple[tuple[int, int], ...] = (
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
class PrefillPass:
    """One pass over the stream: percentiles and total of its times to first token, and its
    worst relative error of the last logits against eager's (0 for eager itself)."""

    p50_ms: float
    p90_ms: float
    total_s: float
    error: float


@dataclass
class PrefillReport:
    """A prefill run: what ran where, the stream, and each pass (:data:`PASSES`)."""

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
    prompt_tokens: int
    passes: dict[str, PrefillPass] = field(default_factory=dict)
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
        lines = [
            f"{self.model} ({self.adapter} adapter), {self.dtype}, {self.device}, {self.date}",
            "",
            f"- versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}",
            f"- command: `{self.command}`",
            f"- {self.requests} requests (seed {self.seed}), {self.images} images, "
            f"{self.prompt_tokens} prompt tokens; each prefill waited for, timed "
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
                f"Time to first token, eager over layergraph: p50 {p50:.2f}x, p90 {p90:.2f}x.",
            ]
        return "\n".join(lines) + "\n"


def draw_requests(
    count: int, sizes: Sequence[tuple[int, int]], seed: int
) -> list[list[tuple[int, int]]]:
    """``count`` requests of 1 to 3 images each, their sizes drawn from ``sizes``."""
    rng = random.Random(seed)
    return [[rng.choice(sizes) for _ in range(rng.randint(1, 3))] for _ in range(count)]


def run_prefill(
    model: str | ExampleModel,
    requests: int = 60,
    *,
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] = PREFILL_SIZES,
    dtype: torch.dtype = torch.bfloat16,
    observe_calls: int | None = None,
) -> PrefillReport:
    """The stream of ``requests`` through the example VLM ``model`` (a name of
    ``layergraph bench --list-models`` whose example has a ``prompt``, or the example itself),
    eager and then wrapped (two passes); see the module's text. ``observe_calls`` goes to
    ``wrap`` (``None``: its default)."""
    example = get_registry().example_model(model) if isinstance(model, str) else model
    if example.prompt is None:
        raise ValueError(
            f"{example.name} is no VLM with example prompts; a prefill needs one (such as "
            f"qwen2.5-vl-3b)"
        )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        dtype = torch.float32
    torch.manual_seed(seed)
    vlm = example.build(dtype, device)
    drawn = draw_requests(requests, sizes, seed)
    prompts = [example.prompt(images, dtype, device) for images in drawn]
    report = PrefillReport(
        model=example.name,
        adapter=example.adapter,
        device=torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
        dtype=str(dtype).removeprefix("torch."),
        graphs_kind="cuda" if cuda else "simulated",
        versions=versions_in_use(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["layergraph", *sys.argv[1:]])
        if sys.argv[0].endswith("layergraph")
        else f"run_prefill({example.name!r}, {requests})",
        seed=seed,
        requests=requests,
        images=sum(len(images) for images in drawn),
        prompt_tokens=sum(prompt["input_ids"].shape[1] for prompt in prompts),
    )
    with torch.inference_mode():
        _prefill(vlm, prompts[0])  # warm-up: kernels load, caches fill
        timed = [_timed(lambda p=prompt: _prefill(vlm, p), device) for prompt in prompts]
        wanted = [logits.float() for logits, _ in timed]
        report.passes["eager"] = _summary([ms for _, ms in timed], [0.0])
        options: dict[str, Any] = {} if observe_calls is None else {"observe_calls": observe_calls}
        graphed = wrap(vlm, backend=None if cuda else SimulatedGraphs(), **options)
        for name in PASSES[1:]:
            times, errors = [], []
            for prompt, want in zip(prompts, wanted):
                logits, ms = _timed(lambda p=prompt: _prefill(graphed, p), device)
                times.append(ms)
                errors.append(relative_error(logits.float(), want))
            report.passes[name] = _summary(times, errors)
        stats = graphed.stats
        report.graphs = stats.graphs
        report.budgets = sorted(key.batch for key in graphed.keys)
        report.capture_seconds = stats.capture_seconds
        report.eager_calls = dict(stats.eager_calls)
        graphed.unwrap()
    return report


def _prefill(model: Callable[..., Any], prompt: dict[str, Any]) -> torch.Tensor:
    """The forward a serving engine runs before the first token: the last position's logits."""
    return model(**prompt, logits_to_keep=1, use_cache=False).logits[:, -1]


def _timed(call: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """One call, waited for: its output and milliseconds (CUDA events on a GPU)."""
    if device.type != "cuda":
        started = time.perf_counter()
        output = call()
        return output, (time.perf_counter() - started) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    output = call()
    end.record()
    end.synchronize()
    return output, start.elapsed_time(end)


def _summary(times: list[float], errors: list[float]) -> PrefillPass:
    """A pass's percentiles (linear between the nearest ranks) and total, and worst error."""
    cuts = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return PrefillPass(
        p50_ms=statistics.median(times),
        p90_ms=cuts[8],
        total_s=sum(times) / 1e3,
        error=max(errors),
    )
