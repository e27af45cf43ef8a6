"""The side-by-side benchmark: eager, layergraph, a hand-written graph, torch.compile.

    from layergraph.bench import run_benchmark
    report = run_benchmark("vit_base_patch16_224", [1, 2, 4, 8, 16, 32])
    print(report.to_markdown())

The same runs from the command line as ``layergraph bench``; ``layergraph bench --stream
120:1-13`` serves a stream of mixed request sizes instead (:func:`run_stream`), and
``layergraph bench --compile-region --start 1,8`` times a cold and a warm start of the speed
options, each in a fresh process (:func:`run_start`). ``layergraph bench --prefill 60`` times a
VLM's first token on a stream of requests (:func:`run_prefill`), and ``--stream`` of a tower
that takes every image at its own size serves it images of mixed sizes
(:func:`run_image_stream`).
"""

from .examples import ExampleModel, example_model, example_model_names
from .report import BenchReport, BenchRow
from .requests import RequestsReport, run_image_stream, run_prefill
from .run import run_benchmark
from .start import StartReport, StartRow, run_start
from .stream import StreamReport, StreamRow, parse_stream, run_stream

__all__ = [
    "BenchReport",
    "BenchRow",
    "ExampleModel",
    "RequestsReport",
    "StartReport",
    "StartRow",
    "StreamReport",
    "StreamRow",
    "example_model",
    "example_model_names",
    "parse_stream",
    "run_benchmark",
    "run_image_stream",
    "run_prefill",
    "run_start",
    "run_stream",
]
