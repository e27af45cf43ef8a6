"""The transformers releases the transformers adapters were checked against.

These adapters (InternVL's and every family of :data:`layergraph_adapters.towers.TOWERS`)
follow transformers' own code: the attention forward of CLIP-style layers
(:func:`layergraph_adapters.fused_qkv.fused_attention_forward`), InternViT's attention (the
routed forward of :mod:`layergraph_adapters.internvl`), and where a model keeps its tower,
layers and embeddings (each family's :class:`~layergraph_adapters.tower_specs.TowerSpec`).
Another release may change that code, and a copy that no longer matches it computes something
else without failing, so the plans refuse transformers outside the checked range
(:func:`require_transformers`).
"""

from __future__ import annotations

import os

from layergraph import AdapterMismatch

__all__ = ["TRANSFORMERS_CHECKED", "UNCHECKED_VARIABLE", "require_transformers"]

TRANSFORMERS_CHECKED = ">=5.6.0,<5.25"
"""The transformers releases the adapters serve, as a version specifier: 5.6.0 to 5.24.x.

The adapters' CPU tests, and the coverage test, pass with 5.6.0, 5.8.1, 5.12.1, 5.17.0 and
5.24.0. With 5.5.4, graphs that stop at a feature layer (LLaVA's, VipLLaVA's) do not match the
model; with 5.0.0 the fused q/k/v attention fails too. ``pyproject.toml``'s ``transformers``
extra asks for the same range."""

UNCHECKED_VARIABLE = "LAYERGRAPH_UNCHECKED_TRANSFORMERS"
"""The environment variable that, set to ``1``, lets the adapters run with any transformers."""


def require_transformers(adapter_name: str) -> None:
    """Raise :class:`~layergraph.AdapterMismatch` unless the installed transformers was checked.

    For the plans of the adapters that follow transformers' code, before they touch a model.
    The message names the installed release, the checked range and how to proceed. Pre-releases
    inside the range pass; setting :data:`UNCHECKED_VARIABLE` to ``1`` skips the check.
    """
    if os.environ.get(UNCHECKED_VARIABLE) == "1":
        return
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            f"the {adapter_name} adapter needs transformers: pip install 'layergraph[transformers]'"
        ) from error
    from packaging.specifiers import SpecifierSet

    installed = transformers.__version__
    if SpecifierSet(TRANSFORMERS_CHECKED).contains(installed, prereleases=True):
        return
    raise AdapterMismatch(
        f"the {adapter_name} adapter was checked with transformers{TRANSFORMERS_CHECKED}, and "
        f"transformers {installed} is installed. Install a checked release "
        f"(pip install 'transformers{TRANSFORMERS_CHECKED}'), or set {UNCHECKED_VARIABLE}=1 to "
        f"run it with {installed} anyway and compare its outputs with the unwrapped model's"
    )
