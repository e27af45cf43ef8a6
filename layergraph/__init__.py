"""layergraph: capture a vision encoder's layer stack into CUDA graphs and replay them.

graphed = layergraph.wrap(model, adapter="timm")
out = graphed(pixel_values)  # same outputs as model(pixel_values), replayed from a graph
"""

from .adapter import (
    PLUGIN_API_VERSION,
    Adapter,
    AdapterMismatch,
    CapturePlan,
    PlanContext,
    WholeForward,
    moved_example_model,
)
from .hookspecs import hookimpl
from .keys import ShapeKey
from .ledger import Change, ChangeLedger
from .module import GraphedModule, unwrap, wrap
from .multi_tower import GraphedTowers
from .plugins import AdapterInfo, PluginFailureWarning, UnknownAdapterError, list_adapters
from .runner import DEFAULT_BATCH_SIZES, RunnerOptions
from .sequential import SequentialAdapter
from .serving.gate import EagerModeWarning
from .stats import GraphStats
from .validation import GraphMismatchError
from .version import __version__
from .warn import LayergraphDeprecationWarning

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "PLUGIN_API_VERSION",
    "Adapter",
    "AdapterInfo",
    "AdapterMismatch",
    "CapturePlan",
    "Change",
    "ChangeLedger",
    "EagerModeWarning",
    "GraphMismatchError",
    "GraphStats",
    "GraphedModule",
    "GraphedTowers",
    "LayergraphDeprecationWarning",
    "PlanContext",
    "PluginFailureWarning",
    "RunnerOptions",
    "SequentialAdapter",
    "ShapeKey",
    "UnknownAdapterError",
    "WholeForward",
    "__version__",
    "hookimpl",
    "list_adapters",
    "unwrap",
    "wrap",
]


def __getattr__(name: str) -> object:
    """``ExampleModel``, moved to :mod:`layergraph.bench.examples`, with a
    ``LayergraphDeprecationWarning`` (``layergraph.ExampleModel`` goes in 0.3)."""
    if name == "ExampleModel":
        return moved_example_model(__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
