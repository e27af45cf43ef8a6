"""Warm starts: Inductor's artifacts saved by one process and loaded by a fresh one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import layergraph
from layergraph import warm_start
from layergraph.testing import SimulatedGraphs
from layergraph.warm_start import (
    WarmStartMismatch,
    load_warm_start,
    save_warm_start,
    warm_start_origin,
)

PROCESS = textwrap.dedent(
    """
    import json, os, sys, torch, layergraph
    from pathlib import Path
    from torch._dynamo.utils import counters
    from layergraph.testing import SimulatedGraphs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    path, load = sys.argv[1], sys.argv[2] == "load"
    compiled = {"region": {"compile_region": True},
                "auto": {"compile_layers": {"auto": True, "background": True}}}[sys.argv[3]]
    graphed = layergraph.wrap(
        model.eval(), adapter="sequential", backend=SimulatedGraphs(), batch_sizes=[2],
        warm_start=path if load else None, **compiled,
    )
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    before = sorted(str(f.relative_to(cache)) for f in cache.rglob("*") if f.is_file())
    kernel = Path(os.environ["TRITON_CACHE_DIR"]) / "KERNELHASH" / "kernel.cubin"
    with torch.inference_mode():
        graphed(torch.randn(2, 8))
        graphed.finish_compiling()  # layers compiled in the background: taken at the next call
        graphed(torch.randn(2, 8))
    if not load:  # what a Triton kernel compiled in this process leaves in Triton's cache
        kernel.parent.mkdir(parents=True)
        kernel.write_bytes(b"compiled")
        graphed.save_warm_start(path)
    print(json.dumps({**counters["inductor"], "files_before_compiling": before,
                      "triton_kernel": kernel.exists() and kernel.read_bytes().decode(),
                      "fusion": str(graphed.stats.fusion.get(2))}))
    """
)


def run_process(tmp_path: Path, cache: str, mode: str, compiled: str = "region") -> dict[str, Any]:
    """A fresh process with an Inductor cache of its own (a new machine's, say)."""
    environment = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache),
        "TRITON_CACHE_DIR": str(tmp_path / cache / "triton-own"),
    }
    result = subprocess.run(
        [sys.executable, "-c", PROCESS, str(tmp_path / "warm.lgws"), mode, compiled],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("compiled", ["region", "auto"])
def test_a_fresh_process_compiles_from_the_saved_artifacts(tmp_path: Path, compiled: str) -> None:
    """The compiled region, or layers compiled in the background and measured (``{"auto":
    True, "background": True}``): a second process compiles nothing Inductor compiled in the
    first."""
    cold = run_process(tmp_path, "first-machine", "save", compiled)
    assert cold.get("fxgraph_cache_miss", 0) >= 1
    warm = run_process(tmp_path, "second-machine", "load", compiled)
    if compiled == "auto":
        assert "compiled against" in cold["fusion"] and "compiled against" in warm["fusion"]
    assert warm.get("fxgraph_cache_hit", 0) >= 1 and warm.get("fxgraph_cache_miss", 0) == 0
    assert cold["files_before_compiling"] == []
    first = {
        str(f.relative_to(tmp_path / "first-machine"))
        for f in (tmp_path / "first-machine").rglob("*")
    }
    carried = set(warm["files_before_compiling"])
    assert carried <= first
    # Compiled kernels come with the file, beside the graphs Inductor's artifacts hold.
    kernels = {name for name in carried if not name.startswith(("fxgraph/", "aotautograd/"))}
    assert any(name.endswith(".so") for name in kernels), sorted(carried)
    # So do the files in Triton's cache, though the loading process had not imported Triton.
    assert warm["triton_kernel"] == "compiled"


def test_a_file_made_elsewhere_is_not_loaded_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.lgws"
    origin = {**warm_start_origin(), "device": "NVIDIA H200", "torch": "2.11.0+cu130"}
    header = json.dumps({"origin": origin, "artifacts_bytes": 0, "files_bytes": 0}).encode()
    path.write_bytes(b"layergraph warm start 2\n" + header + b"\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_warm_start(path) is False
    (warning,) = caught
    assert warning.category is WarmStartMismatch
    assert "device 'NVIDIA H200'" in str(warning.message) and "torch '2.11.0+cu130'" in str(
        warning.message
    )
    assert warning.filename == __file__


def test_bad_files_get_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "not-a-warm-start"
    path.write_bytes(b"something else")
    with pytest.raises(ValueError, match="not a layergraph warm-start file"):
        load_warm_start(path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="not a layergraph warm-start file"):
        layergraph.wrap(model, warm_start=path)


def test_saving_before_anything_compiled_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    monkeypatch.setattr(warm_start, "_bundle_cache_files", lambda: b"")
    with pytest.raises(RuntimeError, match="nothing was compiled in this process and nothing"):
        save_warm_start(tmp_path / "empty.lgws")


def slow_at_eight(rows: int) -> float:
    """Replays that beat eager (3 ms of launches, 0.5 ms a row) below 8 rows only."""
    return 1.0 + 0.5 * rows + (100.0 if rows >= 8 else 0.0)


def test_a_replica_starts_from_the_measurements_and_skips_graphs_that_lose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first wrapper measures batches 2 and 8 (the graph of 8 loses to eager); a second
    wrapper of the same model, loading the file, captures 2 but never 8."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()

    def wrapped(**options: Any) -> layergraph.GraphedModule:
        backend = SimulatedGraphs(eager_ms=lambda rows: 3 + 0.5 * rows, replay_ms=slow_at_eight)
        return layergraph.wrap(model, adapter="sequential", backend=backend, **options)

    first = wrapped()
    with torch.inference_mode():
        for batch in (2, 8):
            first(torch.randn(batch, 8))
    assert first.stats.slower_graphs == 1
    measured = first.stats.costs
    path = tmp_path / "measured.lgws"
    assert first.save_warm_start(path) > 0
    first.unwrap()
    replica = wrapped(warm_start=path)
    assert replica.fingerprint == first.fingerprint
    assert replica.stats.costs == measured
    with torch.inference_mode():
        for batch in (2, 8, 8):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(replica(x), model(x))
    stats = replica.stats
    assert stats.captures == 1 and stats.served[(8, "eager")] == 2 and stats.slower_graphs == 0
    replica.unwrap()
    bigger = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stranger = layergraph.wrap(
            bigger, adapter="sequential", backend=SimulatedGraphs(), warm_start=path
        )
    assert stranger.stats.costs == {}
    assert [w.category for w in caught] == [WarmStartMismatch]
    assert "measurements of another model" in str(caught[0].message)
