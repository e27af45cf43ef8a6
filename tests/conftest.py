"""Shared fixtures: a fresh plugin registry, fake installed plugins, tiny models."""

from __future__ import annotations

import functools
import importlib
import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from quick_check import QUICK

from layergraph import plugins

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on machines without a GPU. The variable is
    # read when a kernel module is imported, so it is set before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@functools.cache
def triton_interpreter_fault() -> str | None:
    """Why Triton's interpreter cannot run the project's kernels on this machine, or None.

    The kernels loop up to bounds loaded from memory (sequence lengths). Triton 3.6's
    interpreter turns such a bound into a Python int in a way NumPy 2.4 refuses; Triton 3.8
    with NumPy 2.4, and Triton 3.6 with NumPy 2.3, both run it.
    """
    if torch.cuda.is_available():
        return None
    try:
        import numpy
        import triton
    except ImportError as error:
        return f"{error.name} is not installed"
    from _triton_probe import count_to_loaded_bound

    bound, counted = torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    try:
        count_to_loaded_bound[(1,)](bound, counted)
    except Exception as error:  # the interpreter's own error types differ between versions
        return (
            f"Triton {triton.__version__}'s interpreter cannot run a loop to a bound loaded "
            f"from memory with NumPy {numpy.__version__} ({type(error).__name__}: {error})"
        )
    if counted.item() != 3:
        return f"Triton {triton.__version__}'s interpreter counted {counted.item()} to 3"
    return None


@pytest.fixture
def runnable_triton() -> None:
    """Skips the test where Triton's interpreter cannot run the project's kernels."""
    fault = triton_interpreter_fault()
    if fault is not None:
        pytest.skip(fault)


SLOW_FILES = frozenset(
    {
        "test_add_norm_kernel.py",
        "test_bench.py",
        "test_bench_profile.py",
        "test_bench_start.py",
        "test_cli.py",
        "test_coverage.py",
        "test_docs.py",
        "test_docs_render.py",
        "test_docs_site.py",
        "test_embedding_service_bench.py",
        "test_families_benchmark.py",
        "test_fused_norm.py",
        "test_ledger.py",
        "test_packed_towers_bench.py",
        "test_plots.py",
        "test_qwen2_vl_fused_norm.py",
        "test_siglip2_naflex_bench.py",
        "test_tensor_parallel.py",
        "test_triton_varlen.py",
        "test_vlm_prefill_bench.py",
        "test_warm_start.py",
        "test_wheel.py",
    }
)
"""The test files marked ``slow``, left out of the quick check (``pytest -m "not slow"``):
Triton's interpreter, fresh processes (the command, benchmarks, builds), the docs site, and
the coverage walk; tests named for the Triton kernel (run in its interpreter) are marked too.
Together about four fifths of the suite's time on two cores."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow, quick = pytest.mark.slow, pytest.mark.quick
    for item in items:
        if item.path.name in SLOW_FILES or "triton" in item.name:
            item.add_marker(slow)
        chosen = QUICK.get(item.path.name, ())
        if item.name in chosen or getattr(item, "originalname", item.name) in chosen:
            item.add_marker(quick)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def float32_without_tf32() -> Iterator[None]:
    """Convolutions and matrix products in float32, not TF32, for the test; the settings
    restored after it. ``monkeypatch`` cannot do this: ``torch.backends.cuda.matmul`` computes
    ``allow_tf32``, so undoing a patch of it tries to delete it."""
    allowed = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = allowed


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Plugins are loaded again on first use in the test, and once more after it."""
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    plugins.reset_registry()
    yield
    plugins.reset_registry()


@pytest.fixture
def installed_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> Callable[[str, str, str], None]:
    """Install a fake distribution whose ``layergraph`` entry point is a module of given source."""

    def install(distribution: str, entry_point: str, source: str) -> None:
        module = f"{distribution}_plugin"
        info = tmp_path / f"{distribution}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.2.3\n"
        )
        (info / "entry_points.txt").write_text(f"[layergraph]\n{entry_point} = {module}\n")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    return install


@pytest.fixture
def mlp_stack() -> torch.nn.Sequential:
    """A small stack of layers applied in sequence, with random weights, in eval mode."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)
    ).eval()


@pytest.fixture(scope="module")
def saved_vit_builder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], torch.nn.Module]:
    """A builder of a two-layer timm ViT (32x32 images, patches of 8, no classifier) whose
    weights load from a local file, so that every build, in this process or in another (a
    Ray actor), has the same weights."""
    timm = pytest.importorskip("timm")
    make = functools.partial(
        timm.create_model,
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=8,
        depth=2,
        num_classes=0,
    )
    path = tmp_path_factory.mktemp("weights") / "vit.pth"
    torch.manual_seed(0)
    torch.save(make().state_dict(), path)
    return functools.partial(make, pretrained=True, pretrained_cfg_overlay={"file": str(path)})
