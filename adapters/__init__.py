"""First-party layergraph adapters, installed as ``layergraph_adapters``.

Each module at this level is a plugin of the entry-point group ``layergraph``, loaded exactly
like a third party's; what the plugins are built from is in :mod:`layergraph_adapters.kit`. A
module imports its model framework (timm, transformers) only when one of its adapters is used,
never when the plugin is loaded.

The modules that moved into ``kit`` in 0.2 keep their old import paths for 0.2, with a
``LayergraphDeprecationWarning`` (``layergraph_adapters.hf_vision`` is
``layergraph_adapters.kit.hf_vision``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

from layergraph.warn import LayergraphDeprecationWarning

_MOVED_TO_KIT = frozenset(
    {
        "aligned_mlp",
        "automatic",
        "feature_outputs",
        "fused_norm",
        "fused_qkv",
        "gelu_epilogue",
        "grid_positions",
        "hf_vision",
        "idefics",
        "internvl_tp",
        "layout",
        "mllama",
        "naflex",
        "packed_tower",
        "patch_embedding",
        "rewrites",
        "tokens",
        "tower_specs",
        "versions",
    }
)
"""The modules that moved from ``layergraph_adapters`` into ``layergraph_adapters.kit``."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old path as the same module object at its new one, warning."""

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        package, _, module = name.rpartition(".")
        if package != __name__ or module not in _MOVED_TO_KIT:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = spec.name.rpartition(".")[2]
        warnings.warn(
            f"{spec.name} moved to {__name__}.kit.{module}; the old path goes in 0.3",
            LayergraphDeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(f"{__name__}.kit.{module}")

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new path's, already executed."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
