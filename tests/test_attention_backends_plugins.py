"""Attention backends registered by plugins: listing, lookup, choice, metadata and failures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import layergraph
from layergraph import plugins
from layergraph.attention import (
    AttentionBackend,
    AttentionMetadata,
    SdpaAttention,
    SequenceLayout,
    choose_backend,
)
from layergraph.plugins import AdapterRegistry, UnknownAttentionBackendError

CPU = torch.device("cpu")
LAYOUT = SequenceLayout.uniform(2, 5)

TOY_PLUGIN = """
    import layergraph
    from layergraph.attention import AttentionMetadata, SdpaAttention


    class ToyAttention(SdpaAttention):
        name = "toy"
        calls = 0

        def default_metadata(self, layout, device):
            return AttentionMetadata(max_seqlen=layout.max_length + 1000)

        def __call__(self, q, k, v, **kwargs):
            ToyAttention.calls += 1
            return super().__call__(q, k, v, **kwargs)


    @layergraph.hookimpl
    def register_attention_backends(register):
        register(ToyAttention())
"""


class ToyAttention(SdpaAttention):
    """A dense backend that wraps SDPA, counts its calls and marks its metadata."""

    name = "toy"

    def __init__(self) -> None:
        self.calls = 0

    def default_metadata(self, layout: SequenceLayout, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(max_seqlen=layout.max_length + 1000)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(q, k, v, **kwargs)


class Registers:
    """A plugin registering ``backends`` and, optionally, an adapter."""

    def __init__(self, *backends: Any, adapter: type[layergraph.Adapter] | None = None) -> None:
        self.backends = backends
        self.adapter = adapter

    @layergraph.hookimpl
    def register_adapters(self, register: Callable[..., None]) -> None:
        if self.adapter is not None:
            register(self.adapter)

    @layergraph.hookimpl
    def register_attention_backends(self, register: Callable[..., None]) -> None:
        for backend in self.backends:
            register(backend)


def failures(registry: AdapterRegistry) -> dict[str, str | None]:
    return {info.name: info.error for info in registry.list() if not info.ok}


def test_builtin_backends_are_registered_by_layergraphs_own_plugin() -> None:
    registry = AdapterRegistry()
    assert registry.attention_backend_names() == ("sdpa", "triton", "fa3")
    infos = {info.name: info for info in registry.list_attention_backends()}
    assert {info.distribution for info in infos.values()} == {"layergraph"}
    assert infos["sdpa"].version == layergraph.__version__
    assert isinstance(registry.attention_backend("triton"), AttentionBackend)
    assert registry.attention_backends() == tuple(
        registry.attention_backend(name) for name in registry.attention_backend_names()
    )


def test_a_backend_is_described_by_its_name_and_what_runs_where_they_differ() -> None:
    registry = AdapterRegistry()
    sdpa, fa3 = registry.attention_backend("sdpa"), registry.attention_backend("fa3")
    assert sdpa.described == "sdpa"
    assert fa3.described == f"fa3 ({fa3.implementation})" != "fa3"


def test_plugin_backend_is_listed_chosen_by_name_and_run() -> None:
    toy = ToyAttention()
    registry = AdapterRegistry()
    registry.add_plugin(Registers(toy), "toy-plugin", "toydist", "2.0")
    assert registry.attention_backend_names() == ("sdpa", "triton", "fa3", "toy")
    assert registry.attention_backend("toy") is toy
    (info,) = [info for info in registry.list_attention_backends() if info.name == "toy"]
    assert (info.distribution, info.version) == ("toydist", "2.0")

    backends = registry.attention_backends()
    chosen = choose_backend("toy", CPU, torch.float32, 2, 16, LAYOUT, backends=backends)
    assert chosen is toy
    q, k, v = torch.randn(3, LAYOUT.total, 2, 16).unbind(0)
    metadata = registry.attention_metadata(backend="toy", layout=LAYOUT, device=CPU)
    out = chosen(q, k, v, layout=LAYOUT, metadata=metadata, workspace=None, scale=0.25)
    expected = SdpaAttention()(
        q, k, v, layout=LAYOUT, metadata=metadata, workspace=None, scale=0.25
    )
    torch.testing.assert_close(out, expected)
    assert toy.calls == 1


def test_metadata_hook_comes_before_the_backends_own() -> None:
    class Metadata:
        @layergraph.hookimpl
        def attention_metadata(
            self, backend: str, layout: SequenceLayout, device: torch.device
        ) -> AttentionMetadata | None:
            return AttentionMetadata(max_seqlen=-1) if backend == "toy" else None

    registry = AdapterRegistry()
    registry.add_plugin(Registers(ToyAttention()), "toy-plugin")
    toy_default = registry.attention_metadata(backend="toy", layout=LAYOUT, device=CPU)
    assert toy_default == AttentionMetadata(max_seqlen=1005)
    registry.add_plugin(Metadata(), "metadata-plugin")
    assert registry.attention_metadata(backend="toy", layout=LAYOUT, device=CPU).max_seqlen == -1
    assert registry.attention_metadata(backend="sdpa", layout=LAYOUT, device=CPU).max_seqlen == 5


def test_auto_chooses_among_the_backends_given() -> None:
    toy = ToyAttention()
    registry = AdapterRegistry()
    registry.add_plugin(Registers(toy), "toy-plugin")
    everything = registry.attention_backends()
    assert choose_backend("auto", CPU, torch.float32, 2, 16, LAYOUT, backends=everything).name == (
        "sdpa"
    )
    assert choose_backend("auto", CPU, torch.float32, 2, 16, LAYOUT, backends=(toy,)) is toy
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'; choose one of toy"):
        choose_backend("sdpa", CPU, torch.float32, 2, 16, LAYOUT, backends=(toy,))
    packed = SequenceLayout((3, 4))
    with pytest.raises(RuntimeError, match=r"no attention backend can run.*toy: sdpa needs"):
        choose_backend("auto", CPU, torch.float32, 2, 16, packed, backends=(toy,))


@pytest.mark.parametrize(
    ("backend", "error"),
    [
        (
            SdpaAttention(),
            "ValueError: attention backend 'sdpa' is already registered by layergraph",
        ),
        ("flash", "TypeError: register_attention_backends takes AttentionBackend instances"),
        (SdpaAttention, "TypeError: register_attention_backends takes AttentionBackend instances"),
    ],
    ids=["name clash", "a string", "a class"],
)
def test_bad_backend_fails_its_plugin_as_a_whole(backend: Any, error: str) -> None:
    class Adapter(layergraph.Adapter):
        name = "with-bad-backend"

    registry = AdapterRegistry()
    registry.add_plugin(Registers(backend, adapter=Adapter), "bad-plugin", "baddist", "0.1")
    assert failures(registry)["bad-plugin"].startswith(error)
    assert registry.attention_backend_names() == ("sdpa", "triton", "fa3")
    with pytest.raises(plugins.UnknownAdapterError, match="with-bad-backend"):
        registry.factory("with-bad-backend")


def test_reserved_and_repeated_names_fail_the_plugin() -> None:
    class Auto(SdpaAttention):
        name = "auto"

    registry = AdapterRegistry()
    registry.add_plugin(Registers(Auto()), "auto-plugin")
    registry.add_plugin(Registers(ToyAttention(), ToyAttention()), "twice-plugin")
    assert "'auto' is reserved" in failures(registry)["auto-plugin"]
    assert "'toy' is registered twice" in failures(registry)["twice-plugin"]


def test_unknown_backend_lists_the_names_and_failed_plugins() -> None:
    class Raising:
        @layergraph.hookimpl
        def register_attention_backends(self, register: Callable[..., None]) -> None:
            raise ImportError("no kernel library")

    registry = AdapterRegistry()
    registry.add_plugin(Registers(ToyAttention()), "toy-plugin")
    registry.add_plugin(Raising(), "raising-plugin", "raisingdist", "1.0")
    with pytest.raises(UnknownAttentionBackendError) as raised:
        registry.attention_backend("flash")
    message = str(raised.value)
    assert "no attention backend named 'flash'; registered: fa3, sdpa, toy, triton" in message
    assert "raising-plugin (raisingdist): ImportError: no kernel library" in message
    with pytest.raises(UnknownAttentionBackendError, match="'flash'"):
        registry.attention_metadata(backend="flash", layout=LAYOUT, device=CPU)


def test_removing_a_plugin_forgets_its_backends() -> None:
    registry = AdapterRegistry()
    registry.add_plugin(Registers(ToyAttention()), "toy-plugin")
    registry.remove_plugin("toy-plugin")
    assert "toy" not in registry.attention_backend_names()
    registry.add_plugin(Registers(ToyAttention()), "toy-plugin")
    assert registry.attention_backend("toy").name == "toy"


def test_installed_backend_shows_in_the_adapters_command(
    installed_plugin: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from layergraph import cli

    installed_plugin("toybackend", "toy-backend", TOY_PLUGIN)
    assert plugins.get_registry().attention_backend("toy").name == "toy"
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["adapters"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if cells:
            rows[cells[0]] = cells
    assert rows["toy"] == ["toy", "toybackend", "1.2.3"]
    assert rows["sdpa"] == ["sdpa", "layergraph", layergraph.__version__]


@pytest.mark.cuda
def test_auto_times_plugin_backends_with_the_builtin_ones_on_the_gpu() -> None:
    class Copying(SdpaAttention):
        """Copies q instead of attending: far faster than any real kernel, so timed fastest."""

        name = "copying"

        def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: Any) -> Any:
            return q.clone()

    copying = Copying()
    registry = AdapterRegistry()
    registry.add_plugin(Registers(copying), "copying-plugin")
    cuda, layout = torch.device("cuda"), SequenceLayout.uniform(8, 1025)
    backends = registry.attention_backends()
    assert choose_backend("auto", cuda, torch.float16, 16, 64, layout, backends=backends) is copying
    chosen = choose_backend("sdpa", cuda, torch.float16, 16, 64, layout, backends=backends)
    assert chosen is registry.attention_backend("sdpa")
