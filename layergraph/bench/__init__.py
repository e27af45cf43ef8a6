"""The side-by-side benchmark: eager, layergraph, a hand-written graph, torch.compile.

    from layergraph.bench import run_benchmark
    report = run_benchmark("vit_base_patch16_224", [1, 2, 4, 8, 16, 32])
    print(report.to_markdown())

The same runs from the command line as ``layergraph bench``.
"""

from .report import BenchReport, BenchRow
from .run import run_benchmark

__all__ = ["BenchReport", "BenchRow", "run_benchmark"]
