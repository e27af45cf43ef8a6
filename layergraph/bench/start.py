"""Cold and warm starts of the speed options, each timed in a fresh process.

The speed options that compile (``compile_layers``, ``compile_region``) make a replica's start
slow: Inductor compiles every captured shape. A warm-start file (:mod:`layergraph.warm_start`)
carries what one process compiled to the next. :func:`run_start` measures both starts as a new
replica meets them, each in a process of its own with empty Inductor and Triton caches (what a
fresh machine has):

- cold: builds the model, wraps it with the options, captures every batch size, and saves a
  warm-start file;
- warm: the same, with ``wrap(..., warm_start=file)``.

Each process reports the seconds from ``wrap`` to every graph ready (the start), the seconds to
build the model and to import torch's compiler (before it, apart: any process that compiles
pays that import once), Inductor's cache hits and misses over the start, and the
worst relative error of a replay against eager after it. ``layergraph bench --start 1,8`` runs
it from the command line.

The processes run :func:`_main` of this module through ``python -c``, given their parameters as
JSON, and print their result as one JSON line after :data:`RESULT_PREFIX`.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..module import wrap
from ..validation import compare_outputs
from .examples import example_model
from .report import describe_options
from .run import versions_in_use

__all__ = ["RESULT_PREFIX", "StartReport", "StartRow", "run_start"]

RESULT_PREFIX = "layergraph start result: "
"""What starts the line of a start process's output that holds its result as JSON."""

CACHE_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
"""The counters of ``torch._dynamo.utils.counters`` that a start reports, by group: Inductor's
FX graph cache (one hit or miss per compiled graph) and AOTAutograd's cache in front of it."""

_PROCESS = "import sys; from layergraph.bench.start import _main; _main(sys.argv[1])"


@dataclass
class StartRow:
    """One start, in a fresh process with empty Inductor and Triton caches."""

    process: str
    """``"cold"`` (nothing compiled before; saves the warm-start file) or ``"warm"`` (loads
    it)."""
    start_s: float
    """Seconds from ``wrap`` to every graph captured: the warm-start file loaded (warm), the
    layers or region compiled, every batch size captured. Torch's compiler is imported
    before (:attr:`compiler_import_s`)."""
    build_s: float
    """Seconds to build the model with random weights and move it to the device, before
    ``wrap``; the first CUDA work of the process falls here."""
    process_s: float
    """The whole process, as the parent timed it: interpreter and imports, build, start, then
    saving the file (cold) and the check against eager."""
    compile_s: float
    """Seconds of calls that compiled (``GraphedModule.compile_budget.spent``)."""
    graphs: int
    """Graphs held after the start."""
    captures: int
    """Graphs captured during the start."""
    cache: dict[str, int]
    """Cache counters over the start (:data:`CACHE_COUNTERS`), zeros included."""
    worst_error: float
    """The largest relative error of a replay against eager, over the batch sizes."""
    warnings: list[str] = field(default_factory=list)
    """layergraph's warnings during the start, ``"Category: message"``."""
    save_s: float | None = None
    """Seconds to save the warm-start file (cold only)."""
    file_bytes: int | None = None
    """Bytes of compiled artifacts in the warm-start file (cold only)."""
    compiler_import_s: float | None = None
    """Seconds to import Dynamo, Inductor and Triton, after the build and before ``wrap``:
    what any process pays once before it first compiles (a serving process has usually paid
    it already), kept out of :attr:`start_s`. ``None`` in reports from before it was timed."""

    @property
    def hits(self) -> int:
        """Graphs Inductor found in its cache."""
        return self.cache.get("fxgraph_cache_hit", 0)

    @property
    def misses(self) -> int:
        """Graphs Inductor compiled."""
        return self.cache.get("fxgraph_cache_miss", 0)


@dataclass
class StartReport:
    """A cold start and a warm start of one model with the same options and batch sizes."""

    model: str
    adapter: str
    device: str
    dtype: str
    graph_backend: str
    """``"CUDA graphs"``, or ``"simulated"`` on the CPU
    (:class:`layergraph.testing.SimulatedGraphs`): there only compiling and its caches are
    real."""
    batch_sizes: list[int]
    options: dict[str, Any]
    """The ``wrap`` options of both starts."""
    versions: dict[str, str]
    date: str
    command: str
    cold: StartRow
    warm: StartRow

    @property
    def speedup(self) -> float:
        """The cold start's seconds over the warm start's."""
        return self.cold.start_s / self.warm.start_s

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["speedup"] = self.speedup
        return record

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read_json(cls, path: str | Path) -> StartReport:
        """A report written by :meth:`write_json`."""
        record = json.loads(Path(path).read_text())
        record.pop("speedup", None)
        cold, warm = StartRow(**record.pop("cold")), StartRow(**record.pop("warm"))
        return cls(**record, cold=cold, warm=warm)

    def to_markdown(self) -> str:
        """The setting, then one table row per start."""
        sizes = ", ".join(map(str, self.batch_sizes))
        lines = [
            f"{self.model} ({self.adapter} adapter), {self.dtype}, {self.device} "
            f"({self.graph_backend}), {self.date}",
            "",
            f"- versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}",
            f"- command: `{self.command}`",
            f"- options: {describe_options(self.options)}; batch sizes {sizes}",
            f"- each start in a fresh process with empty Inductor and Triton caches; the warm "
            f"one loads the {_mib(self.cold.file_bytes)} file the cold one saved "
            f"(in {self.cold.save_s:.2f} s)",
            "",
            "| start | wrap to graphs s | cold / this | model build s | compiler import s | "
            "whole process s | compiling s | graphs | FX graph cache hits / misses | "
            "AOTAutograd cache hits / misses | worst error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in (self.cold, self.warm):
            lines.append(
                f"| {row.process} | {row.start_s:.2f} | "
                f"{self.cold.start_s / row.start_s:.2f}x | {row.build_s:.2f} | "
                f"{_seconds(row.compiler_import_s)} | "
                f"{row.process_s:.2f} | {row.compile_s:.2f} | {row.graphs} | "
                f"{row.hits} / {row.misses} | {row.cache.get('autograd_cache_hit', 0)} / "
                f"{row.cache.get('autograd_cache_miss', 0)} | {row.worst_error:.2e} |"
            )
        return "\n".join(lines) + "\n"


def run_start(
    model_name: str,
    batch_sizes: Sequence[int],
    options: Mapping[str, Any],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | None = None,
    file: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    on_process: Callable[[str], None] | None = None,
) -> StartReport:
    """Time a cold start and a warm start of ``model_name`` wrapped with ``options``.

    ``options`` are ``wrap``'s speed options and must compile (``compile_layers`` or
    ``compile_region``): without compiled code there is nothing to warm-start, and a
    ``ValueError`` says so. Both starts capture every size of ``batch_sizes`` from an example
    of one image. ``device`` is ``"cuda"`` or ``"cpu"`` (default: the GPU if there is one);
    on the CPU the model runs in float32 and the graphs are simulated
    (:class:`layergraph.testing.SimulatedGraphs`). The warm-start file is kept at ``file`` if
    given, else written to a temporary directory. ``timeout`` limits each process's seconds;
    ``on_process`` is called with ``"cold"`` and then ``"warm"`` as each process starts.

    Raises ``RuntimeError`` with the end of its error output if a process fails, which includes
    a replay that differs from eager beyond the dtype's tolerance
    (:data:`layergraph.validation.DEFAULT_TOLERANCE`).
    """
    settings = dict(options)
    if all(settings.get(name, False) is False for name in ("compile_layers", "compile_region")):
        raise ValueError(
            "a warm start holds what compile_layers or compile_region compiled: without one of "
            "them nothing is compiled and there is nothing to warm-start"
        )
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be at least 1, got {list(batch_sizes)}")
    example = example_model(model_name)
    if example.sized_inputs is not None:
        raise ValueError(
            f"{example.name} takes every image at its own size: its token budgets are "
            f"captured when calls need them, not ahead at batch sizes"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cpu":
        dtype = torch.float32
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory(prefix="layergraph-start-") as scratch:
        path = Path(file) if file is not None else Path(scratch) / "warm-start.lgws"
        parameters = {
            "model": model_name,
            "batch_sizes": sizes,
            "options": settings,
            "dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "file": str(path),
        }
        rows: dict[str, StartRow] = {}
        facts: dict[str, Any] = {}
        for process in ("cold", "warm"):
            if on_process is not None:
                on_process(process)
            caches = Path(scratch) / process
            row, facts = _run_process({**parameters, "process": process}, caches, timeout)
            rows[process] = row
    return StartReport(
        model=example.name,
        adapter=example.adapter,
        device=facts["device"],
        dtype=parameters["dtype"],
        graph_backend="CUDA graphs" if device == "cuda" else "simulated",
        batch_sizes=sizes,
        options=settings,
        versions=facts["versions"],
        date=date,
        command=" ".join(["layergraph", *sys.argv[1:]])
        if sys.argv[0].endswith("layergraph")
        else f"run_start({model_name!r}, {sizes}, {settings!r})",
        cold=rows["cold"],
        warm=rows["warm"],
    )


def _run_process(
    parameters: dict[str, Any], caches: Path, timeout: float | None
) -> tuple[StartRow, dict[str, Any]]:
    """One start in a fresh interpreter whose Inductor and Triton caches are empty directories
    of ``caches``; its row, and what it found out about the machine."""
    environment = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    process = parameters["process"]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROCESS, json.dumps(parameters)],
            capture_output=True,
            text=True,
            env=environment,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {process} start ran past {timeout:g} s") from None
    elapsed = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the {process} start failed (exit status {done.returncode}):\n{done.stderr[-4000:]}"
        )
    result = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    facts = {name: result.pop(name) for name in ("device", "versions")}
    return StartRow(process=process, process_s=elapsed, **result), facts


def _main(text: str) -> None:
    """A start process: measure the start :func:`_measure` describes, print its result."""
    result = _measure(json.loads(text))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _measure(parameters: dict[str, Any]) -> dict[str, Any]:
    """Build, wrap, capture (timed); save the warm-start file (cold) or load it (warm, through
    ``wrap``); then check every batch size's replay against eager.

    Returns the fields of a :class:`StartRow` except ``process`` and ``process_s``, with the
    device's name and the versions.
    """
    from torch._dynamo.utils import counters

    from ..testing import SimulatedGraphs

    example = example_model(parameters["model"])
    device = torch.device(parameters["device"])
    dtype = getattr(torch, parameters["dtype"])
    sizes = parameters["batch_sizes"]
    warm = parameters["process"] == "warm"
    torch.manual_seed(0)
    with torch.inference_mode():
        started = time.perf_counter()
        model = example.build(dtype, device)
        _synchronize(device)
        build_s = time.perf_counter() - started
        started = time.perf_counter()
        _import_compiler()
        compiler_import_s = time.perf_counter() - started
        args, kwargs = example.inputs(1, dtype, device)
        with warnings.catch_warnings(record=True) as caught:
            started = time.perf_counter()
            graphed = wrap(
                model,
                adapter=example.adapter,
                batch_sizes=sizes,
                warm_start=parameters["file"] if warm else None,
                backend=SimulatedGraphs() if device.type == "cpu" else None,
                **parameters["options"],
            )
            graphed.capture(*args, batch_sizes=sizes, progress=False, **kwargs)
            _synchronize(device)
            start_s = time.perf_counter() - started
        cache = {
            name: counters[group][name] for group, names in CACHE_COUNTERS.items() for name in names
        }
        stats = graphed.stats
        result: dict[str, Any] = {
            "start_s": start_s,
            "build_s": build_s,
            "compiler_import_s": compiler_import_s,
            "compile_s": graphed.compile_budget.spent,
            "graphs": stats.graphs,
            "captures": stats.captures,
            "cache": cache,
            "warnings": _layergraph_warnings(caught),
        }
        if not warm:
            started = time.perf_counter()
            result["file_bytes"] = graphed.save_warm_start(parameters["file"])
            result["save_s"] = time.perf_counter() - started
        result["worst_error"] = _check(graphed, example, sizes, dtype, device)
    cuda = device.type == "cuda"
    result["device"] = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})"
    result["versions"] = versions_in_use()
    return result


def _check(
    graphed: Any,
    example: Any,
    sizes: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> float:
    """The worst relative error of each batch size's replay against the unwrapped model.

    Raises ``GraphMismatchError`` beyond the dtype's tolerance, and ``RuntimeError`` if a call
    ran eagerly instead of replaying.
    """
    eager_before = graphed.stats.eager_total
    worst = 0.0
    for batch in sizes:
        args, kwargs = example.inputs(batch, dtype, device)
        got = graphed(*args, **kwargs)
        with graphed.original() as original:
            expected = original(*args, **kwargs)
        worst = max(worst, compare_outputs(got, expected, tolerance=None, context=f"batch {batch}"))
    if graphed.stats.eager_total != eager_before:
        raise RuntimeError(f"a call ran eagerly instead of replaying: {graphed.stats}")
    return worst


def _layergraph_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """layergraph's warnings among ``caught``, as ``"Category: message"``; others are shown
    as they would have been."""
    ours = []
    for warning in caught:
        if warning.category.__module__.startswith("layergraph"):
            ours.append(f"{warning.category.__name__}: {warning.message}")
        else:
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    return ours


def _import_compiler() -> None:
    """Import what ``torch.compile`` imports on its first call: Dynamo, Inductor and, where
    it is installed, Triton.

    Every process that compiles pays this once, whatever it compiles; a serving process has
    usually paid it before it wraps its vision tower. Timed apart from the start so that the
    start is what wrapping itself costs.
    """
    import torch._dynamo
    import torch._inductor.compile_fx  # noqa: F401

    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f} MiB"
