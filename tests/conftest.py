"""Shared fixtures: a fresh plugin registry, fake installed plugins, tiny models."""

from __future__ import annotations

import importlib
import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from layergraph import plugins

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on machines without a GPU. The variable is
    # read when a kernel module is imported, so it is set before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
