"""Plots of the packed towers' runs: speed against tokens per call, and the streams.

    python3 benchmarks/plots.py docs/results/RUN.json ... --out docs/results/NAME

Reads JSON files written by ``benchmarks/packed_towers.py`` (a ``towers`` list) and
``benchmarks/siglip2_naflex.py`` (one ``tower``), and writes two PNGs:

- ``NAME-calls.png``: per tower, eager's and the hand-written graph's latency over
  layergraph's (the speedup of layergraph; above 1, layergraph is faster) against the tokens
  of the call, one panel per tower;
- ``NAME-streams.png``: per tower, the seconds a stream of requests took, each call waited
  for: eager, layergraph's first pass (which observes and captures), layergraph after, and the
  hand-written graphs (one per padded shape, captures not counted).

Made on any machine from the JSON of a GPU run (matplotlib, no GPU).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["calls_of", "main", "plot_calls", "plot_streams", "streams_of"]


def towers_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each tower's record in a run: the ``towers`` of a packed-towers run, or the run itself."""
    return record.get("towers", [record])


def calls_of(tower: dict[str, Any]) -> list[dict[str, Any]]:
    """A tower's per-call rows (``images`` of a packed-towers run, ``calls`` of a NaFlex run),
    by tokens, those with every method measured."""
    rows = tower.get("images") or tower.get("calls") or []
    kept = [
        row
        for row in rows
        if all(row.get(f"{name}_ms") for name in ("eager", "hand_graph", "layergraph"))
    ]
    return sorted(kept, key=lambda row: row["tokens"])


def streams_of(tower: dict[str, Any]) -> dict[str, float]:
    """A tower's stream: seconds by method."""
    stream = tower.get("stream") or {}
    names = {
        "eager": "eager_s",
        "layergraph, first pass": "layergraph_first_pass_s",
        "layergraph": "layergraph_s",
        "hand-written graphs": "hand_graph_s",
    }
    return {label: stream[key] for label, key in names.items() if stream.get(key)}


def plot_calls(towers: list[dict[str, Any]], path: Path) -> None:
    """:func:`calls_figure` as a PNG."""
    save(calls_figure(towers), path)


def calls_figure(towers: list[dict[str, Any]]) -> Any:
    """Speedup over eager and over the hand-written graph against tokens, a panel per tower,
    the legend above the panels."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [tower for tower in towers if calls_of(tower)]
    columns = min(3, len(shown))
    rows = math.ceil(len(shown) / columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False, sharey=False
    )
    for axis, tower in zip(axes.flat, shown):
        calls = calls_of(tower)
        tokens = [row["tokens"] for row in calls]
        for name, label, style in (
            ("eager", "eager / layergraph", "o-"),
            ("hand_graph", "hand-written graph / layergraph", "s--"),
        ):
            axis.plot(
                tokens,
                [row[f"{name}_ms"] / row["layergraph_ms"] for row in calls],
                style,
                label=label,
            )
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_ylim(bottom=0)
        axis.set_title(tower.get("tower", "?"))
        axis.set_xlabel("tokens per call")
        axis.set_ylabel("speedup of layergraph")
        axis.grid(True, which="both", alpha=0.3)
    for axis in list(axes.flat)[len(shown) :]:
        axis.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2)
    figure.tight_layout()
    return figure


def save(figure: Any, path: Path) -> None:
    """Write ``figure`` to ``path``, its legend (outside the axes) included, and close it."""
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def plot_streams(towers: list[dict[str, Any]], path: Path) -> None:
    """:func:`streams_figure` as a PNG."""
    save(streams_figure(towers), path)


def streams_figure(towers: list[dict[str, Any]]) -> Any:
    """Seconds of each tower's stream, by method, as grouped bars, the legend beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [tower for tower in towers if streams_of(tower)]
    labels = list(dict.fromkeys(label for tower in shown for label in streams_of(tower)))
    width = 0.8 / max(1, len(labels))
    figure, axis = plt.subplots(figsize=(max(5.0, 1.6 * len(shown) + 2), 3.6))
    for index, label in enumerate(labels):
        axis.bar(
            [position + index * width for position in range(len(shown))],
            [streams_of(tower).get(label, 0.0) for tower in shown],
            width,
            label=label,
        )
    axis.set_xticks([position + 0.4 - width / 2 for position in range(len(shown))])
    axis.set_xticklabels([tower.get("tower", "?") for tower in shown], fontsize="small")
    axis.set_ylabel("seconds for the stream")
    axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files of the runs")
    parser.add_argument("--out", required=True, help="the PNGs' path without -calls.png")
    args = parser.parse_args(argv)
    towers = [tower for run in args.runs for tower in towers_of(json.loads(run.read_text()))]
    if not any(calls_of(tower) for tower in towers):
        parser.error("no tower in these runs has calls timed by every method")
    written = [Path(f"{args.out}-calls.png")]
    plot_calls(towers, written[0])
    if any(streams_of(tower) for tower in towers):
        written.append(Path(f"{args.out}-streams.png"))
        plot_streams(towers, written[1])
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
