"""The demo: a timm ViT with random weights, graphed, checked against eager, and timed.

Nothing is downloaded: the model is built from timm's config for its name. Without a GPU the
demo says so, runs the eager path through the wrapper, and shows why the calls ran eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from .module import wrap
from .progress import status
from .reference import plain_graph
from .runner import DEFAULT_BATCH_SIZES
from .timing import median_ms
from .validation import DEFAULT_TOLERANCE, relative_error

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["DemoReport", "DemoResult", "run_demo"]


@dataclass(frozen=True)
class DemoResult:
    """One batch size's check and timings (milliseconds, medians)."""

    batch: int
    relative_error: float
    eager_ms: float
    graphed_ms: float
    plain_graph_ms: float | None

    @property
    def speedup(self) -> float:
        """Eager latency over graphed latency."""
        return self.eager_ms / self.graphed_ms

    @property
    def versus_plain_graph(self) -> float | None:
        """layergraph latency over the hand-written graph's (1.0: as fast)."""
        return None if self.plain_graph_ms is None else self.graphed_ms / self.plain_graph_ms

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "speedup": self.speedup,
            "versus_plain_graph": self.versus_plain_graph,
        }


@dataclass(frozen=True)
class DemoReport:
    """The demo's results, and what capturing every bucket cost (zero without a GPU)."""

    results: list[DemoResult]
    capture_seconds: float
    pool_bytes: int
    largest_alone_pool_bytes: int

    @property
    def pool_ratio(self) -> float | None:
        """Pool bytes of all buckets over those of the largest bucket captured alone."""
        if not self.largest_alone_pool_bytes:
            return None
        return self.pool_bytes / self.largest_alone_pool_bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "capture_seconds": self.capture_seconds,
            "pool_bytes": self.pool_bytes,
            "largest_alone_pool_bytes": self.largest_alone_pool_bytes,
            "pool_ratio": self.pool_ratio,
            "results": [result.as_dict() for result in self.results],
        }


def run_demo(
    model_name: str,
    batch_sizes: Sequence[int],
    dtype: torch.dtype,
    iters: int,
    console: Console,
) -> DemoReport:
    """Build, wrap, capture, check and time ``model_name``; print progress on ``console``.

    On a GPU the largest bucket is first captured alone into a pool of its own (then unwrapped),
    for comparison, and then every bucket into one shared pool, largest first.
    """
    import timm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        console.print(
            "[yellow]No CUDA GPU here: CUDA graphs need one. The wrapper runs the eager path on "
            "the CPU, so both columns time the same computation.[/]"
        )
        dtype = torch.float32
    console.print(f"building {model_name} from its config (random weights, no download)")
    model = timm.create_model(model_name, pretrained=False).to(device, dtype).eval()
    config = model.pretrained_cfg
    image_shape = tuple(config.get("input_size", (3, 224, 224)))

    def images(batch: int) -> torch.Tensor:
        return torch.randn((batch, *image_shape), device=device, dtype=dtype)

    results = []
    largest_alone = 0
    with torch.inference_mode():
        if cuda:
            largest_alone = _pool_bytes_alone(model, images(1), batch=max(DEFAULT_BATCH_SIZES))
        graphed = wrap(model, adapter="timm", batch_sizes=DEFAULT_BATCH_SIZES)
        if cuda:
            keys = graphed.capture(images(1), progress=False)
            stats = graphed.stats
            console.print(
                f"captured {len(keys)} graphs (batch {', '.join(str(k.batch) for k in keys)}) "
                f"in {stats.capture_seconds:.2f} s into one pool of "
                f"{stats.pool_bytes / 2**20:.0f} MiB; batch {keys[0].batch} alone: "
                f"{largest_alone / 2**20:.0f} MiB ({stats.pool_bytes / largest_alone:.2f}x)"
            )
        tolerance = DEFAULT_TOLERANCE[dtype]
        for batch in batch_sizes:
            with status(console, f"batch {batch}: checking against eager, timing {iters} calls"):
                x = images(batch)
                error = relative_error(graphed(x), model(x))
                if not error <= tolerance:
                    raise RuntimeError(
                        f"batch {batch}: graph differs from eager (relative error {error:.3g} "
                        f"> {tolerance:.3g})"
                    )
                eager = median_ms(lambda x=x: model(x), device=device, iters=iters)
                fast = median_ms(lambda x=x: graphed(x), device=device, iters=iters)
                plain = None
                if cuda:
                    by_hand = plain_graph(model, x)
                    plain = median_ms(lambda x=x, run=by_hand: run(x), device=device, iters=iters)
                    del by_hand
            console.print(
                f"batch {batch}: answers as eager (relative error {error:.1e}); eager "
                f"{eager:.2f} ms, through the wrapper {fast:.2f} ms"
            )
            results.append(DemoResult(batch, error, eager, fast, plain))
    stats = graphed.stats
    console.print(str(stats))
    return DemoReport(results, stats.capture_seconds, stats.pool_bytes, largest_alone)


def _pool_bytes_alone(model: torch.nn.Module, example: torch.Tensor, batch: int) -> int:
    """Pool bytes of one batch size captured alone into its own pool, released afterwards."""
    alone = wrap(model, adapter="timm", batch_sizes=[batch])
    alone.capture(example, progress=False)
    size = alone.stats.pool_bytes
    alone.unwrap()
    return size
