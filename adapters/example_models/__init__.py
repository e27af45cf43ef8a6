"""layergraph's own example models, a plugin of the entry-point group ``layergraph`` apart
from the adapters: towers and VLMs built from their configurations with random weights, and
inputs for them, for the demo, ``layergraph bench`` and the benchmarks
(:mod:`layergraph.bench.examples`). The adapters never import this package, and loading the
plugin imports none of its tables: they are read when an example is asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from layergraph.hookspecs import hookimpl

if TYPE_CHECKING:
    from layergraph.bench.examples import ExampleModel

__all__ = ["example_model", "example_model_names"]


@hookimpl
def example_model(name: str) -> ExampleModel | None:
    from layergraph_adapters.example_models.frameworks import open_clip_example, timm_example
    from layergraph_adapters.example_models.packed import packed_example
    from layergraph_adapters.example_models.towers import tower_example

    for find in (tower_example, packed_example, open_clip_example, timm_example):
        found = find(name)
        if found is not None:
            return found
    return None


@hookimpl
def example_model_names() -> list[str]:
    from layergraph_adapters.example_models.frameworks import TIMM_NAMES, open_clip_names
    from layergraph_adapters.example_models.packed import PACKED_EXAMPLES
    from layergraph_adapters.example_models.towers import TOWER_EXAMPLES

    return [*TOWER_EXAMPLES, *PACKED_EXAMPLES, *TIMM_NAMES, *open_clip_names()]
