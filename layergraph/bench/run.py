"""Running the benchmark: one model, several batch sizes, every method in one process."""

from __future__ import annotations

import contextlib
import datetime
import functools
import platform
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ..module import wrap
from ..reference import compiled_reduce_overhead, plain_graph
from ..timing import matmul_peak_tflops, median_ms, waited_ms
from ..validation import first_tensor, relative_error
from ..version import __version__
from .examples import ExampleModel, example_model
from .profile import flops_by_kind, profile_call
from .report import BenchReport, BenchRow

__all__ = ["run_benchmark"]


def run_benchmark(
    model_name: str | ExampleModel,
    batch_sizes: Sequence[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 100,
    compile: bool = False,
    tuned: Mapping[str, Any] | None = None,
    profile: bool = False,
    image_size: tuple[int, int] | None = None,
    on_row: Callable[[BenchReport], None] | None = None,
) -> BenchReport:
    """Time ``model_name`` (an example model, or its name) at each batch size, all methods.

    On a GPU: eager; layergraph (``wrap``'s defaults) with every batch size captured ahead
    into one pool (capture time and pool size recorded, and the largest batch captured alone
    for comparison; a graph not measured faster than eager is not kept, and its batch is served
    eagerly, as ``layergraph_served`` says); the
    whole forward captured by hand; each of these three also with a wait for every call's
    result (the ``*_wait_ms`` fields, the latency a waiting caller feels); with ``tuned``
    (``wrap`` options such as ``{"compile_region": True, "fuse_qkv": True}``), layergraph
    again with those speed options, after the plain measurements since some of them change the
    model in place until unwrapped; and, with ``compile=True``, torch.compile with
    ``mode="reduce-overhead"`` (which compiles once per batch size, for a long time) last of
    all, once layergraph's graphs are released. Without a GPU only eager is measured, in
    float32. With ``profile``, each batch size's layergraph call (eager's without a GPU) is
    profiled by kernel class (:mod:`layergraph.bench.profile`, ``BenchRow.profile``).
    ``image_size`` (``(height, width)`` in pixels) feeds a model that takes every image at its
    own size (an example with ``sized_inputs``: the native-resolution towers) images of that
    size; a batch is then that many images in one call. Such a tower's graphs are per token
    budget and cannot be captured ahead: each batch size is wrapped afresh and captured at its
    first call (``capture_seconds`` sums them, ``pool_bytes`` is the largest pool), the
    hand-written graph and torch.compile are not measured (its forward reads the images'
    grid on the host, which a capture refuses), and ``BenchReport.notes`` says so.
    ``on_row`` is called with the report after each batch size, for live display.
    """
    example = example_model(model_name) if isinstance(model_name, str) else model_name
    inputs = example.inputs
    if image_size is not None:
        sized = example.sized_inputs
        if sized is None:
            raise ValueError(
                f"{example.name} takes images of one size; an image size is for the towers "
                f"that take every image at its own size"
            )
        inputs = functools.partial(_at_size, sized, tuple(image_size))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        dtype = torch.float32
    sizes = sorted(set(batch_sizes))
    model = example.build(dtype, device)
    report = BenchReport(
        model=example.name,
        adapter=example.adapter,
        device=torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
        dtype=str(dtype).removeprefix("torch."),
        versions=versions_in_use(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["layergraph", *sys.argv[1:]])
        if sys.argv[0].endswith("layergraph")
        else f"run_benchmark({model_name!r}, {sizes})",
        iters=iters,
        tuned_options=dict(tuned or {}),
        image_size=None if image_size is None else tuple(image_size),
    )
    packed = cuda and _packs(model, example.adapter)
    if packed:
        report.notes += [
            "captured per token budget: each batch size wrapped afresh, its budget captured "
            "at its first call",
            "hand-written graph and torch.compile not measured: the tower's forward reads "
            "its images' grid on the host, which a capture refuses",
        ]
    with torch.inference_mode():
        graphed = None
        if cuda:
            report.matmul_tflops = matmul_peak_tflops(device, dtype)
            if not packed:
                graphed = _capture_all(model, example.adapter, inputs, sizes, dtype, device, report)
        for batch in sizes:
            args, kwargs = inputs(batch, dtype, device)
            if packed:
                graphed = _capture_packed(model, example.adapter, args, kwargs, report)
            row = _measure(
                model,
                graphed,
                args,
                kwargs,
                batch,
                device,
                iters,
                by_hand=not packed,
                capturable=example.capturable,
            )
            if profile:
                target = graphed if graphed is not None else model
                row.profile = _profile(target, args, kwargs, device)
            report.rows.append(row)
            if on_row is not None:
                on_row(report)
            if packed:
                graphed.unwrap()
        if graphed is not None and not packed:
            graphed.unwrap()
        if cuda and report.tuned_options:
            _measure_tuned(model, example.adapter, inputs, packed, dtype, device, iters, report)
            if on_row is not None:
                on_row(report)
        if cuda and compile and not packed:
            _measure_torch_compile(model, inputs, dtype, device, iters, report)
            if on_row is not None:
                on_row(report)
    return report


def _at_size(
    sized: Callable[..., Any],
    size: tuple[int, int],
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    """An example's ``sized_inputs`` at one image size, called as its ``inputs``."""
    return sized([size] * batch, dtype, device)


def _packs(model: torch.nn.Module, adapter: str) -> bool:
    """Whether ``adapter``'s plan for ``model`` packs calls into token budgets; wrapping to
    find out is undone."""
    graphed = wrap(model, adapter=adapter)
    try:
        return graphed.plan.packing is not None
    finally:
        graphed.unwrap()


def _capture_packed(
    model: torch.nn.Module,
    adapter: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    report: BenchReport,
) -> Any:
    """``model`` wrapped afresh for one call, its budget captured by that call (budgets
    planned from the first call, none observed); the capture's seconds added to the
    report's and its pool kept if the largest."""
    graphed = wrap(model, adapter=adapter, observe_calls=0)
    started = time.perf_counter()
    graphed(*args, **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    stats = graphed.stats
    report.capture_seconds = (report.capture_seconds or 0.0) + stats.capture_seconds
    report.capture_wall_seconds = (report.capture_wall_seconds or 0.0) + wall
    report.pool_bytes = max(report.pool_bytes or 0, stats.pool_bytes)
    return graphed


def _measure_tuned(
    model: torch.nn.Module,
    adapter: str,
    inputs: Callable[..., Any],
    packed: bool,
    dtype: torch.dtype,
    device: torch.device,
    iters: int,
    report: BenchReport,
) -> None:
    """layergraph with ``report.tuned_options``, each batch size captured at its first call
    (a packed tower's budgets planned from the calls, none observed)."""
    options = {"observe_calls": 0, **report.tuned_options} if packed else report.tuned_options
    graphed = wrap(model, adapter=adapter, **options)
    for row in report.rows:
        args, kwargs = inputs(row.batch, dtype, device)
        with graphed.original() as original:
            expected = original(*args, **kwargs)
        got = graphed(*args, **kwargs)
        row.tuned_error = relative_error(first_tensor(got), first_tensor(expected))
        row.tuned_ms = median_ms(
            lambda args=args, kwargs=kwargs: graphed(*args, **kwargs), device=device, iters=iters
        )
    report.tuned_compile_seconds = graphed.compile_budget.spent
    graphed.unwrap()


def _measure_torch_compile(
    model: torch.nn.Module,
    inputs: Callable[..., Any],
    dtype: torch.dtype,
    device: torch.device,
    iters: int,
    report: BenchReport,
) -> None:
    """torch.compile(mode="reduce-overhead") of the unwrapped model at every batch size."""
    torch._dynamo.reset()
    compiled = compiled_reduce_overhead(model)
    for row in report.rows:
        args, kwargs = inputs(row.batch, dtype, device)
        started = time.perf_counter()
        for _ in range(3):
            compiled(*args, **kwargs)
        torch.cuda.synchronize()
        row.compile_seconds = time.perf_counter() - started
        row.compile_ms = median_ms(
            lambda args=args, kwargs=kwargs: compiled(*args, **kwargs), device=device, iters=iters
        )


def _capture_all(
    model: torch.nn.Module,
    adapter: str,
    inputs: Callable[..., Any],
    sizes: list[int],
    dtype: torch.dtype,
    device: torch.device,
    report: BenchReport,
) -> Any:
    """Wrap and capture every size; record capture time and pool sizes on ``report``.

    First the largest size alone, released; then every size into the shared pool that the
    benchmark uses. Neither pool holds a cuBLAS workspace (those live in the capture stream's
    anchor pool, :mod:`layergraph.capture_streams`), so the two compare like for like.
    """
    args, kwargs = inputs(1, dtype, device)
    report.largest_alone_pool_bytes = _pool_alone(model, adapter, sizes[-1], args, kwargs)
    graphed = wrap(model, adapter=adapter)
    started = time.perf_counter()
    graphed.capture(*args, batch_sizes=sizes, progress=False, **kwargs)
    torch.cuda.synchronize()
    report.capture_wall_seconds = time.perf_counter() - started
    stats = graphed.stats
    report.capture_seconds = stats.capture_seconds
    report.pool_bytes = stats.pool_bytes
    return graphed


def _pool_alone(
    model: torch.nn.Module, adapter: str, batch: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    alone = wrap(model, adapter=adapter, batch_sizes=[batch])
    alone.capture(*args, progress=False, **kwargs)
    size = alone.stats.pool_bytes
    alone.unwrap()
    return size


def _measure(
    model: torch.nn.Module,
    graphed: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: int,
    device: torch.device,
    iters: int,
    by_hand: bool = True,
    capturable: Callable[[torch.nn.Module], contextlib.AbstractContextManager[Any]] | None = None,
) -> BenchRow:
    """One batch size. Eager and the references run on the model as it was before wrapping;
    the hand-written graph only with ``by_hand``, captured inside ``capturable(model)`` where
    the example gives one (:attr:`ExampleModel.capturable`)."""
    with graphed.original() if graphed is not None else contextlib.nullcontext(model) as original:
        with _parameters_frozen(original), FlopCounterMode(display=False) as counter:
            expected = original(*args, **kwargs)
        matmul, attention = flops_by_kind(counter)
        row = BenchRow(
            batch=batch,
            eager_ms=median_ms(lambda: original(*args, **kwargs), device=device, iters=iters),
            gflop=counter.get_total_flops() / 1e9,
            matmul_gflop=matmul,
            attention_gflop=attention,
        )
        if graphed is None:
            return row
        row.eager_wait_ms = waited_ms(lambda: original(*args, **kwargs), device=device, iters=iters)
        if by_hand:
            with capturable(original) if capturable else contextlib.nullcontext():
                graph = plain_graph(original, *args, **kwargs)
                row.plain_graph_ms = median_ms(
                    lambda: graph(*args, **kwargs), device=device, iters=iters
                )
                row.plain_graph_wait_ms = waited_ms(
                    lambda: pytree.tree_map_only(torch.Tensor, torch.clone, graph(*args, **kwargs)),
                    device=device,
                    iters=iters,
                )
    got = graphed(*args, **kwargs)
    row.relative_error = relative_error(first_tensor(got), first_tensor(expected))
    row.layergraph_ms = median_ms(lambda: graphed(*args, **kwargs), device=device, iters=iters)
    row.layergraph_wait_ms = waited_ms(lambda: graphed(*args, **kwargs), device=device, iters=iters)
    row.layergraph_served = ", ".join(
        sorted({way for size, way in graphed.stats.served if size == batch})
    )
    return row


def _profile(
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
) -> dict[str, Any]:
    """``call(*args, **kwargs)`` by kernel class (:func:`~layergraph.bench.profile.profile_call`),
    as a plain dict for the report."""
    return asdict(profile_call(lambda: call(*args, **kwargs), device=device))


@contextlib.contextmanager
def _parameters_frozen(model: torch.nn.Module) -> Iterator[None]:
    """``requires_grad`` off for ``model``'s parameters while counting FLOPs, restored after.

    FlopCounterMode's module tracker hooks the gradient of every module input that requires
    grad, which fails under inference mode when a parameter is itself an input (the latent
    query of timm's attention pooling, for one).
    """
    frozen = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)


def versions_in_use() -> dict[str, str]:
    """The versions of Python, torch, CUDA, the model libraries imported and layergraph."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    for name in ("timm", "transformers", "triton"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    versions["layergraph"] = __version__
    return versions
