"""The ``layergraph bench`` command's runs and tables, once its arguments are parsed
(:mod:`layergraph.cli` parses them): the side-by-side run, ``--stream`` and ``--start``."""

from __future__ import annotations

import argparse
import ast
import json
from typing import TYPE_CHECKING, Any

from ..progress import status

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["bench_command"]


def _tuned_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``wrap`` options of ``bench``'s tuned measurement, from its flags."""
    compiled: bool | dict[str, Any] = True
    if args.inductor_option:
        settings = dict(option.split("=", 1) for option in args.inductor_option)
        compiled = {"options": {name: _literal(value) for name, value in settings.items()}}
    flags = {
        "compile_layers": args.compile_layers and compiled,
        "compile_region": args.compile_region and compiled,
        "fuse_qkv": args.fuse_qkv,
        "patch_matmul": args.patch_matmul,
        "fuse_gelu": args.fuse_gelu,
        "fuse_norm": args.fuse_norm,
    }
    options = {name: value for name, value in flags.items() if value}
    if args.compile_budget is not None:
        options["compile_budget"] = args.compile_budget
    return options


def _folded(table: Any) -> Any:
    """``table`` fitted to a narrow console without cutting a value: each column at least as
    wide as its widest cell, headers wrapped onto more lines (rich's default cuts cells and
    ends them with an ellipsis)."""
    for column in table.columns:
        column.min_width = max((len(str(cell)) for cell in column.cells), default=1)
        column.overflow = "fold"
    return table


def report_table(report: Any) -> Any:
    """The side-by-side run's table (a :class:`~layergraph.bench.BenchReport`'s rows), without
    the columns no row has a value in, fitted to the console without cutting a value."""
    from rich.table import Table

    images = "" if report.image_size is None else " images of {}x{}".format(*report.image_size)
    view = Table(title=f"{report.model} on {report.device}, {report.dtype}{images}")
    labels = report.labels()
    columns: dict[str, list[str]] = {"batch": [str(row.batch) for row in report.rows]}
    for method, label in labels.items():
        columns[f"{label} ms"] = [
            "-"
            if getattr(row, method) is None
            else f"{getattr(row, method):.3f}"
            + (" (eager)" if method == "layergraph_ms" and row.served_eagerly else "")
            for row in report.rows
        ]
    speedups = [row.ratio("eager_ms", "layergraph_ms") for row in report.rows]
    columns["speedup"] = ["-" if x is None else f"{x:.2f}x" for x in speedups]
    for method, name in (
        ("layergraph_ms", "vs hand-written"),
        ("tuned_ms", "tuned vs hand-written"),
    ):
        ratios = [row.ratio(method, "plain_graph_ms") for row in report.rows]
        columns[name] = ["-" if x is None else f"{x:.3f}" for x in ratios]
    shown = {name: cells for name, cells in columns.items() if any(c != "-" for c in cells)}
    for name in shown:
        view.add_column(name)
    for cells in zip(*shown.values()):
        view.add_row(*cells)
    return _folded(view)


def _profile_table(report: Any) -> Any:
    """The profiled rows by kernel class (:meth:`~layergraph.bench.BenchReport.profile_rows`),
    against the floor of their matrix products and attention."""
    from rich.table import Table

    view = Table(title="where each call's time goes, ms per call by kernel class")
    for column in ("batch", "busy", "kernels", *report.profile_classes(), "floor", "over floor"):
        view.add_column(column, justify="right")
    for row in report.profile_rows():
        view.add_row(
            str(row["batch"]),
            f"{row['busy_ms']:.3f}",
            f"{row['kernels']:.0f}",
            *(f"{ms:.3f}" for ms in row["classes"]),
            "-" if row["floor_ms"] is None else f"{row['floor_ms']:.3f}",
            "-" if row["over_floor"] is None else f"{row['over_floor']:.2f}x",
        )
    return view


def _literal(text: str) -> Any:
    """``text`` as a Python literal (``True``, ``4``, ``'x'``), or as the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _bench_stream(console: Console, args: argparse.Namespace) -> int:
    """``bench --stream``: one request mix served by eager, layergraph (and tuned, with
    the tuning flags), fixed buckets and exact keys."""
    import torch

    from .stream import parse_stream, run_stream

    requests = parse_stream(args.stream, args.seed)
    tuned = _tuned_options(args)
    with status(console, f"serving {len(requests)} requests {4 + bool(tuned)} ways..."):
        report = run_stream(
            args.model,
            requests,
            dtype=getattr(torch, args.dtype),
            tuned=tuned,
            passes=args.passes,
        )
    text = report.to_markdown()
    console.print(text, markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report.to_dict(), handle, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    return 0


def _bench_requests(console: Console, args: argparse.Namespace) -> int:
    """``bench --prefill`` (an example VLM's time to first token on a stream), or ``--stream``
    of a tower that takes every image at its own size: eager, then wrapped twice."""
    import torch

    from .requests import run_image_stream, run_prefill
    from .stream import parse_stream

    if not torch.cuda.is_available():
        console.print(
            "[yellow]No CUDA GPU here: the requests run on the CPU in float32 with simulated "
            "graphs, so the times compare nothing a GPU would show.[/]"
        )
    dtype = getattr(torch, args.dtype)
    with status(console, f"requests to {args.model}, eager then wrapped..."):
        if args.prefill is not None:
            report = run_prefill(args.model, args.prefill, seed=args.seed, dtype=dtype)
        else:
            counts = parse_stream(args.stream, args.seed)
            report = run_image_stream(args.model, counts, seed=args.seed, dtype=dtype)
    text = report.to_markdown()
    console.print(text, markup=False, highlight=False)
    if args.json:
        report.write_json(args.json)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    return 0


def _bench_start(console: Console, args: argparse.Namespace) -> int:
    """``bench --start``: a cold and a warm start of the speed options, in fresh processes."""
    import torch
    from rich.table import Table

    from .report import describe_options
    from .start import run_start

    if not torch.cuda.is_available():
        console.print(
            "[yellow]No CUDA GPU here: the starts run on the CPU in float32 with simulated "
            "graphs; compiling and Inductor's caches are real, capture is not.[/]"
        )
    options = _tuned_options(args)
    with status(console, "cold start: compiling with empty caches...") as update:
        report = run_start(
            args.model,
            args.start,
            options,
            dtype=getattr(torch, args.dtype),
            on_process=lambda process: update(
                f"{process} start: "
                + ("compiling with empty caches..." if process == "cold" else "from the file...")
            ),
        )
    sizes = ", ".join(map(str, report.batch_sizes))
    table = Table(
        "start",
        "wrap to graphs s",
        "cold / this",
        "model build s",
        "compiler import s",
        "whole process s",
        "graphs",
        "Inductor cache hits",
        "Inductor cache misses",
        "worst error",
        title=f"{report.model} on {report.device}, {report.dtype}, batch sizes {sizes}: "
        f"layergraph, {describe_options(report.options)}",
    )
    for row in (report.cold, report.warm):
        table.add_row(
            row.process,
            f"{row.start_s:.2f}",
            f"{report.cold.start_s / row.start_s:.2f}x",
            f"{row.build_s:.2f}",
            "-" if row.compiler_import_s is None else f"{row.compiler_import_s:.2f}",
            f"{row.process_s:.2f}",
            str(row.graphs),
            str(row.hits),
            str(row.misses),
            f"{row.worst_error:.2e}",
        )
    console.print(_folded(table))
    console.print(
        f"warm-start file: {(report.cold.file_bytes or 0) / 2**20:.1f} MiB; each start in a "
        f"fresh process with empty Inductor and Triton caches"
    )
    for row in (report.cold, report.warm):
        for warning in row.warnings:
            console.print(f"[yellow]{row.process}: {warning}[/]", highlight=False)
    if args.json:
        report.write_json(args.json)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(report.to_markdown())
    return 0


def bench_command(console: Console, args: argparse.Namespace) -> int:
    """``layergraph bench`` with ``args`` parsed (``args.dtype`` a torch dtype's name): the
    side-by-side run, or ``--stream``, ``--start`` or ``--list-models``; returns the exit
    status."""
    import torch
    from rich.live import Live

    from . import BenchReport, run_benchmark
    from .examples import example_model, example_model_names

    if args.list_models:
        for name in example_model_names():
            console.print(name)
        console.print("timm:NAME (any timm model)")
        console.print("open_clip:NAME (any open_clip architecture's image tower)")
        return 0
    if args.start is not None:
        return _bench_start(console, args)
    if args.prefill is not None or (
        args.stream is not None and example_model(args.model).sized_inputs
    ):
        return _bench_requests(console, args)
    if not torch.cuda.is_available():
        console.print(
            "[yellow]No CUDA GPU here: only the eager path is measured (float32, CPU).[/]"
        )
    if args.stream is not None:
        return _bench_stream(console, args)

    def progress(partial: BenchReport) -> None:
        live.update(report_table(partial))
        if not console.is_terminal:  # a pipe sees no live table: a line per batch measured
            console.print(f"batch {partial.rows[-1].batch} measured", highlight=False)

    sizes = args.batch_sizes
    dtype = getattr(torch, args.dtype)
    if torch.cuda.is_available():
        message = f"building {args.model} and capturing {len(sizes)} batch sizes..."
    else:
        message = f"building {args.model} and timing its eager calls on the CPU..."
    if not console.is_terminal:
        console.print(message, highlight=False)
    with Live(console=console, refresh_per_second=4) as live:
        live.update(message)
        report = run_benchmark(
            args.model,
            sizes,
            dtype=dtype,
            iters=args.iters,
            compile=args.compile,
            tuned=_tuned_options(args),
            profile=args.profile,
            image_size=args.image_size,
            on_row=progress,
        )
    if report.capture_seconds is not None:
        pool = f"pool {report.pool_bytes / 2**20:.0f} MiB"
        if report.pool_ratio is not None:
            pool += (
                f", largest alone {report.largest_alone_pool_bytes / 2**20:.0f} MiB "
                f"({report.pool_ratio:.3f}x)"
            )
        console.print(
            f"capture of {len(sizes)} batch sizes: {report.capture_seconds:.2f} s; {pool}; "
            f"matmul rate {report.matmul_tflops:.0f} TFLOP/s"
        )
    for note in report.notes:
        console.print(note, highlight=False)
    if report.tuned_compile_seconds:
        console.print(f"tuned: compiling took {report.tuned_compile_seconds:.1f} s in all")
    if args.profile:
        console.print(_folded(_profile_table(report)))
    if args.json:
        report.write_json(args.json)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(report.to_markdown())
    if args.plot:
        report.plot(args.plot)
    return 0
