"""Benchmark results and their forms: JSON, a Markdown table, a PNG plot."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["METHODS", "BenchReport", "BenchRow", "describe_options"]

METHODS = {
    "eager_ms": "eager",
    "layergraph_ms": "layergraph",
    "tuned_ms": "layergraph, tuned",
    "plain_graph_ms": "hand-written graph",
    "compile_ms": "torch.compile reduce-overhead",
}
"""The timed methods: the row field holding each one's median latency, and its label
(:meth:`BenchReport.labels` names the tuned options)."""

_OPTION_NAMES = {
    "compile_layers": "compiled layers",
    "compile_region": "compiled region",
    "fuse_qkv": "fused qkv",
    "patch_matmul": "patch matmul",
    "fuse_gelu": "fused gelu",
    "fuse_norm": "fused norm",
    "compile_budget": "compile budget",
}


def describe_options(options: dict[str, Any]) -> str:
    """``wrap`` speed options in words: ``{"compile_region": True, "fuse_qkv": True}`` is
    ``"compiled region, fused qkv"``, and ``{"compile_region": {"options": {"a": 1}}}`` is
    ``"compiled region (a=1)"``."""
    return ", ".join(_describe_option(name, value) for name, value in options.items())


def _describe_option(name: str, value: Any) -> str:
    label = _OPTION_NAMES.get(name)
    if label is None:
        return f"{name}={value!r}"
    if value is True:
        return label
    if name == "compile_budget":
        return f"{label} {value:g} s"
    if isinstance(value, dict):
        settings = {
            **value.get("options", {}),
            **{k: v for k, v in value.items() if k != "options"},
        }
        return f"{label} ({', '.join(f'{k}={v!r}' for k, v in settings.items())})"
    return f"{label} ({value})"


@dataclass
class BenchRow:
    """One batch size: median latencies in milliseconds (``None``: not measured) and FLOPs.

    The ``*_ms`` fields time calls back to back (the throughput of a loop, which hides host
    work); the ``*_wait_ms`` fields time calls each waited for (the latency a waiting caller
    feels).

    ``relative_error`` and ``tuned_error`` compare layergraph's output, without and with the
    report's speed options (:attr:`BenchReport.tuned_options`), to eager's.
    """

    batch: int
    eager_ms: float
    gflop: float
    layergraph_ms: float | None = None
    plain_graph_ms: float | None = None
    compile_ms: float | None = None
    compile_seconds: float | None = None
    tuned_ms: float | None = None
    relative_error: float | None = None
    tuned_error: float | None = None
    eager_wait_ms: float | None = None
    """Eager, each call waited for (:func:`~layergraph.timing.waited_ms`); GPU only."""
    layergraph_wait_ms: float | None = None
    """layergraph, each call waited for: the host work before each replay counts."""
    plain_graph_wait_ms: float | None = None
    """The hand-written graph as a user wraps it (copy in, replay, clone out), each call
    waited for."""
    layergraph_served: str | None = None
    """How layergraph served this batch size (``GraphStats.served``): ``"graph"``, or
    ``"eager"`` where its graph was not measured faster than eager."""
    matmul_gflop: float | None = None
    """GFLOP of eager's matrix products (``FlopCounterMode``)."""
    attention_gflop: float | None = None
    """GFLOP of eager's attention (``FlopCounterMode``; none for a custom kernel)."""
    profile: dict[str, Any] | None = None
    """With ``profile=True``: layergraph's call (eager's without a GPU) by kernel class
    (:class:`~layergraph.bench.profile.CallProfile`: ``busy_ms``, ``kernels``, ``classes``
    of ``name``, ``ms``, ``kernels``, ``longest``)."""

    def floor_ms(self, tflops: float | None) -> float | None:
        """The time eager's matrix products and attention FLOPs take at ``tflops``."""
        if tflops is None or self.matmul_gflop is None:
            return None
        return (self.matmul_gflop + (self.attention_gflop or 0.0)) / tflops

    @property
    def served_eagerly(self) -> bool:
        """Whether layergraph ran this batch eagerly (its graph not measured faster than eager)."""
        return self.layergraph_served is not None and "graph" not in self.layergraph_served

    def ratio(self, numerator: str, denominator: str) -> float | None:
        """``numerator / denominator`` of two latency fields, if both were measured."""
        top, bottom = getattr(self, numerator), getattr(self, denominator)
        return None if top is None or bottom is None else top / bottom

    def tflops(self, method: str) -> float | None:
        """Achieved TFLOP/s of a method at this batch size."""
        ms = getattr(self, method)
        return None if ms is None else self.gflop / ms


@dataclass
class BenchReport:
    """A whole benchmark run: what ran where, capture and memory, and one row per batch."""

    model: str
    adapter: str
    device: str
    dtype: str
    versions: dict[str, str]
    date: str
    command: str
    iters: int
    matmul_tflops: float | None = None
    capture_seconds: float | None = None
    capture_wall_seconds: float | None = None
    pool_bytes: int | None = None
    largest_alone_pool_bytes: int | None = None
    tuned_options: dict[str, Any] = field(default_factory=dict)
    """The ``wrap`` options of the tuned measurement (``compile_region=True``, say); empty if
    it was not measured."""
    tuned_compile_seconds: float | None = None
    """Seconds the tuned measurement's compiled code spent compiling, over every batch size
    (``GraphedModule.compile_budget.spent``)."""
    image_size: tuple[int, int] | None = None
    """The ``(height, width)`` in pixels of the images of a tower that takes every image at its
    own size (``layergraph bench --image-size``); ``None``: the model's one size."""
    notes: list[str] = field(default_factory=list)
    """What the run did otherwise than its methods say, in words (a packed tower's budgets
    captured per batch size, methods not measured)."""
    rows: list[BenchRow] = field(default_factory=list)

    @property
    def pool_ratio(self) -> float | None:
        """Pool of all batch sizes over the pool of the largest captured alone."""
        if not self.pool_bytes or not self.largest_alone_pool_bytes:
            return None
        return self.pool_bytes / self.largest_alone_pool_bytes

    def labels(self) -> dict[str, str]:
        """:data:`METHODS`, with the tuned method named by its options."""
        tuned = (
            f"layergraph, {describe_options(self.tuned_options)}" if self.tuned_options else None
        )
        return {
            method: tuned if method == "tuned_ms" and tuned else label
            for method, label in METHODS.items()
        }

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["pool_ratio"] = self.pool_ratio
        return record

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read_json(cls, path: str | Path) -> BenchReport:
        """A report written by :meth:`write_json`, to render its table or plot again."""
        record = json.loads(Path(path).read_text())
        record.pop("pool_ratio", None)
        if "compiled_layers_options" in record:  # written before the tuned measurement
            record["tuned_options"] = {
                "compile_layers": True,
                **record.pop("compiled_layers_options"),
            }
        rows = [
            BenchRow(**{_LEGACY_FIELDS.get(name, name): value for name, value in row.items()})
            for row in record.pop("rows")
        ]
        if record.get("image_size") is not None:
            record["image_size"] = tuple(record["image_size"])
        return cls(**record, rows=rows)

    def to_markdown(self) -> str:
        """A Markdown section: the setting, then one table row per batch size."""
        lines = [
            f"{self.model} ({self.adapter} adapter), {self.dtype}, {self.device}, {self.date}",
            "",
            f"- versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}",
            f"- command: `{self.command}`",
            *(
                [f"- images of {self.image_size[0]}x{self.image_size[1]} pixels (height x width)"]
                if self.image_size is not None
                else []
            ),
            *(f"- {note}" for note in self.notes),
            f"- medians of {self.iters} calls after warm-up, each timed "
            + ("with CUDA events" if self.matmul_tflops else "by the wall clock"),
        ]
        if self.matmul_tflops:
            lines.append(f"- measured matrix-product rate: {self.matmul_tflops:.0f} TFLOP/s")
        if self.capture_seconds is not None:
            lines.append(
                f"- capture of every batch size: {self.capture_seconds:.2f} s "
                f"({self.capture_wall_seconds:.2f} s wall)"
            )
        if self.pool_ratio is not None:
            lines.append(
                f"- shared pool {self.pool_bytes / 2**20:.0f} MiB; largest batch alone "
                f"{self.largest_alone_pool_bytes / 2**20:.0f} MiB ({self.pool_ratio:.3f}x)"
            )
        if self.tuned_options:
            options = ", ".join(f"{k}={v!r}" for k, v in self.tuned_options.items())
            lines.append(f"- tuned: layergraph wrapped with {options}")
        if self.tuned_compile_seconds:
            lines.append(f"- tuned: compiling took {self.tuned_compile_seconds:.1f} s in all")
        lines += [
            "",
            "speedup is eager over layergraph; the next two columns are layergraph's latency "
            "over the hand-written graph's and over torch.compile reduce-overhead's, then the "
            'same two for tuned layergraph. "(eager)": layergraph measured its graph of that '
            "batch slower than eager at capture, and ran the batch eagerly.",
            "",
            "| batch | GFLOP | eager ms | layergraph ms | hand-written ms | compile-ro ms | "
            "tuned ms | speedup | vs hand-written | vs compile-ro | tuned vs hand-written | "
            "tuned vs compile-ro | eager TFLOP/s | layergraph TFLOP/s | of matmul rate |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
            "| --- |",
        ]
        for row in self.rows:
            achieved = row.tflops("layergraph_ms")
            share = (
                f"{100 * achieved / self.matmul_tflops:.0f} %"
                if achieved is not None and self.matmul_tflops
                else "-"
            )
            eager = row.tflops("eager_ms")
            lines.append(
                f"| {row.batch} | {row.gflop:.1f} | {_ms(row.eager_ms)} | "
                f"{_ms(row.layergraph_ms)}{' (eager)' if row.served_eagerly else ''} | "
                f"{_ms(row.plain_graph_ms)} | {_ms(row.compile_ms)} | "
                f"{_ms(row.tuned_ms)} | "
                f"{_x(row.ratio('eager_ms', 'layergraph_ms'))} | "
                f"{_x(row.ratio('layergraph_ms', 'plain_graph_ms'))} | "
                f"{_x(row.ratio('layergraph_ms', 'compile_ms'))} | "
                f"{_x(row.ratio('tuned_ms', 'plain_graph_ms'))} | "
                f"{_x(row.ratio('tuned_ms', 'compile_ms'))} | {eager:.1f} | "
                f"{'-' if achieved is None else f'{achieved:.1f}'} | {share} |"
            )
        if any(row.layergraph_wait_ms is not None for row in self.rows):
            lines += ["", *self._waited_table()]
        if any(row.profile is not None for row in self.rows):
            lines += ["", *self._profile_table()]
        return "\n".join(lines) + "\n"

    def profile_classes(self) -> list[str]:
        """The kernel classes of the profiled rows, by their time over all rows."""
        spent: dict[str, float] = {}
        for row in self.rows:
            for entry in (row.profile or {}).get("classes", ()):
                spent[entry["name"]] = spent.get(entry["name"], 0.0) + entry["ms"]
        return sorted(spent, key=lambda name: -spent[name])

    def profile_rows(self) -> list[dict[str, Any]]:
        """The profiled rows, one dict each: ``batch``, ``busy_ms``, ``kernels``, ``classes``
        (milliseconds per class of :meth:`profile_classes`, in that order), ``floor_ms``
        and ``over_floor`` (``None`` where no matrix rate was measured)."""
        classes = self.profile_classes()
        rows = []
        for row in self.rows:
            if row.profile is None:
                continue
            by_name = {entry["name"]: entry["ms"] for entry in row.profile["classes"]}
            floor = row.floor_ms(self.matmul_tflops)
            busy = row.profile["busy_ms"]
            rows.append(
                {
                    "batch": row.batch,
                    "busy_ms": busy,
                    "kernels": row.profile["kernels"],
                    "classes": [by_name.get(name, 0.0) for name in classes],
                    "floor_ms": floor,
                    "over_floor": busy / floor if floor else None,
                }
            )
        return rows

    def _profile_table(self) -> list[str]:
        """Where the profiled call spends its time, by kernel class, against the floor of
        its matrix products and attention at the measured matrix rate."""
        classes = self.profile_classes()
        lines = [
            "Where the call's time goes (layergraph's replay on a GPU, eager's operators "
            "without one): milliseconds per call by kernel class; the floor is eager's matrix "
            "products and attention FLOPs at the measured matrix rate.",
            "",
            "| batch | busy ms | kernels | "
            + " | ".join(f"{name} ms" for name in classes)
            + " | floor ms | busy / floor |",
            "| --- | --- | --- | " + " | ".join("---" for _ in classes) + " | --- | --- |",
        ]
        for row in self.profile_rows():
            lines.append(
                f"| {row['batch']} | {_ms(row['busy_ms'])} | {row['kernels']:.0f} | "
                + " | ".join(_ms(ms) for ms in row["classes"])
                + f" | {_ms(row['floor_ms'])} | {_x(row['over_floor'])} |"
            )
        return lines

    def _waited_table(self) -> list[str]:
        """The latency of one call waited for, next to the same calls back to back."""
        lines = [
            "One call with a wait for its result (the first three columns), and the same calls "
            "back to back (the last two); the hand-written graph clones its output, as "
            "layergraph does.",
            "",
            "| batch | eager ms, wait | layergraph ms, wait | hand-written ms, wait | "
            "layergraph vs hand-written, wait | layergraph vs hand-written, loop |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in self.rows:
            lines.append(
                f"| {row.batch} | {_ms(row.eager_wait_ms)} | {_ms(row.layergraph_wait_ms)} | "
                f"{_ms(row.plain_graph_wait_ms)} | "
                f"{_x(row.ratio('layergraph_wait_ms', 'plain_graph_wait_ms'))} | "
                f"{_x(row.ratio('layergraph_ms', 'plain_graph_ms'))} |"
            )
        return lines

    def plot(self, path: str | Path) -> None:
        """A PNG of latency against batch size, one line per method measured, the legend
        beside the axes (:meth:`figure`)."""
        from matplotlib import pyplot as plt

        figure = self.figure()
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)

    def figure(self) -> Any:
        """The matplotlib figure :meth:`plot` saves; the caller closes it."""
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 5.5))
        batches = [row.batch for row in self.rows]
        for method, label in self.labels().items():
            values = [getattr(row, method) for row in self.rows]
            if any(value is not None for value in values):
                axes.plot(batches, values, marker="o", label=label)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(plain)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("batch size")
        axes.set_ylabel("median latency (ms)")
        axes.set_title(f"{self.model}, {self.dtype}, {self.device}")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize="small", frameon=False
        )
        figure.tight_layout()
        return figure


_LEGACY_FIELDS = {"compiled_layers_ms": "tuned_ms", "compiled_layers_error": "tuned_error"}
"""Row fields of reports written before the tuned measurement, and their names now."""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"
