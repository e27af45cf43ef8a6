"""What the packed towers' tests share: a recording attention backend and the plugin that
registers it, and the simulated backend and wrap of the property-based streams."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import layergraph
from layergraph.attention import (
    AttentionMetadata,
    PackedLayout,
    SdpaMaskedAttention,
    build_metadata,
)
from layergraph.testing import SimulatedGraphs


class RecordingAttention(SdpaMaskedAttention):
    """``sdpa_varlen`` that writes the boundaries each run is handed into a tensor of its own
    per metadata, in place: an operation of the graph, so a replay writes them too (a Python
    list appended to would grow at capture only, as on a GPU)."""

    name = "recording"

    def __init__(self) -> None:
        self._read: dict[int, tuple[AttentionMetadata, torch.Tensor]] = {}

    @property
    def seen(self) -> list[tuple[AttentionMetadata, torch.Tensor]]:
        """Each metadata a run was handed, and the boundaries the last run read from it."""
        return list(self._read.values())

    def scrub(self) -> None:
        """Fill what was read with -1, so that only a later run can make it right."""
        with torch.inference_mode():
            for _, read in self._read.values():
                read.fill_(-1)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        metadata = kwargs["metadata"]
        held = self._read.get(id(metadata))
        if held is None:
            held = self._read[id(metadata)] = (metadata, torch.empty_like(metadata.cu_seqlens))
        held[1].copy_(metadata.cu_seqlens)
        return super().__call__(q, k, v, **kwargs)


class RecordingPlugin:
    """Registers a :class:`RecordingAttention` and builds its metadata for packed layouts:
    ``cu_seqlens``, ``seq_lens`` where asked, ``max_seqlen`` as ``build`` says. Records the
    layouts it was asked for and the metadata it built."""

    def __init__(
        self,
        seq_lens: bool = False,
        build: Callable[[PackedLayout], int] = lambda layout: layout.max_length,
    ) -> None:
        self.backend = RecordingAttention()
        self.seq_lens = seq_lens
        self.build = build
        self.asked: list[Any] = []
        self.built: list[AttentionMetadata] = []

    @layergraph.hookimpl
    def register_attention_backends(self, register: Callable[..., None]) -> None:
        register(self.backend)

    @layergraph.hookimpl
    def attention_metadata(
        self, backend: str, layout: Any, device: torch.device
    ) -> AttentionMetadata | None:
        if backend != "recording" or not isinstance(layout, PackedLayout):
            return None
        self.asked.append(layout)
        made = build_metadata(layout, device, cu_seqlens=True, seq_lens=self.seq_lens)
        metadata = AttentionMetadata(self.build(layout), made.cu_seqlens, made.seq_lens)
        self.built.append(metadata)
        return metadata


def wrap_for_stream(
    tower: nn.Module,
    adapter: layergraph.Adapter,
    budgets: Any,
    launches: float,
    **options: Any,
) -> layergraph.GraphedModule:
    """``tower`` wrapped as the property-based streams wrap it: simulated graphs whose eager
    calls cost ``launches`` plus a share per token and whose replays a third of the launches
    and a larger share per token, ``budgets`` a tuple of sizes or what ``batch_sizes`` takes."""
    backend = SimulatedGraphs(
        eager_ms=lambda tokens: launches + 0.01 * tokens,
        replay_ms=lambda tokens: launches / 3 + 0.012 * tokens,
    )
    return layergraph.wrap(
        tower,
        adapter=adapter,
        backend=backend,
        batch_sizes=list(budgets) if isinstance(budgets, tuple) else budgets,
        **options,
    )


def skip_unless_served(family: str) -> None:
    """Skip the calling test module unless the installed transformers is in the range the
    version table gives ``family`` (:data:`~layergraph_adapters.kit.versions.SUPPORT`)."""
    import pytest
    import transformers
    from packaging.specifiers import SpecifierSet

    from layergraph_adapters.kit.versions import SUPPORT

    checked = SUPPORT[family].checked
    if not SpecifierSet(checked).contains(transformers.__version__, prereleases=True):
        pytest.skip(f"{family} is served with transformers{checked}", allow_module_level=True)
