"""The transformers releases the transformers adapters were checked against.

These adapters (InternVL's and every family of :data:`layergraph_adapters.towers.TOWERS`)
follow transformers' own code: the attention forward of CLIP-style layers
(:func:`layergraph_adapters.kit.fused_qkv.fused_attention_forward`), InternViT's attention (the
routed forward of :mod:`layergraph_adapters.internvl`), and where a model keeps its tower,
layers and embeddings (each family's :class:`~layergraph_adapters.kit.tower_specs.TowerSpec`).
Another release may change that code, and a copy that no longer matches it computes something
else without failing, so the plans refuse transformers outside the checked range
(:func:`require_transformers`). A family's :class:`Support` says it all: the range, the
functions that copy transformers' code, what is read from the release's behaviour rather than
its version, and the tests that compare the copies with transformers' own forward, which CI
runs with each family's oldest release (:func:`floors`) as well as the newest.
:data:`TRANSFORMER_TOWERS` is the fixed-resolution families' (and InternVL's and SigLIP2
NaFlex's); a packed family's lives in its record
(:attr:`~layergraph_adapters.kit.packed_tower.PackedFamily.support`), beside the class it
serves. :func:`support_table` (also ``SUPPORT``) gathers them.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

from layergraph import AdapterMismatch
from layergraph.warn import LayergraphDeprecationWarning, warn
from layergraph_adapters.kit.family_record import Support, family_records

__all__ = [
    "TRANSFORMERS_CHECKED",
    "TRANSFORMER_TOWERS",
    "UNCHECKED_VARIABLE",
    "Support",
    "floors",
    "require_transformers",
    "support_table",
]

TRANSFORMERS_CHECKED = ">=5.6.0,<5.25"
"""The transformers releases the adapters serve, as a version specifier: 5.6.0 to 5.24.x.

The adapters' CPU tests, and the coverage test, pass with 5.6.0, 5.8.1, 5.12.1, 5.17.0 and
5.24.0. With 5.5.4, graphs that stop at a feature layer (LLaVA's, VipLLaVA's) do not match the
model; with 5.0.0 the fused q/k/v attention fails too. ``pyproject.toml``'s ``transformers``
extra asks for the same range."""

UNCHECKED_VARIABLE = "LAYERGRAPH_UNCHECKED_TRANSFORMERS"
"""The environment variable that, set to ``1``, lets the adapters run with any transformers."""


def require_transformers(adapter_name: str, checked: str = TRANSFORMERS_CHECKED) -> None:
    """Raise :class:`~layergraph.AdapterMismatch` unless the installed transformers is in the
    ``checked`` range (a version specifier; :data:`TRANSFORMERS_CHECKED` unless the adapter
    needs a narrower one).

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
    if SpecifierSet(checked).contains(installed, prereleases=True):
        return
    raise AdapterMismatch(
        f"the {adapter_name} adapter was checked with transformers{checked}, and "
        f"transformers {installed} is installed. Install a checked release "
        f"(pip install 'transformers{checked}'), or set {UNCHECKED_VARIABLE}=1 to "
        f"run it with {installed} anyway and compare its outputs with the unwrapped model's"
    )


TRANSFORMER_TOWERS = Support(
    "transformers towers",
    TRANSFORMERS_CHECKED,
    copies=(
        "layergraph_adapters.kit.fused_qkv:fused_attention_forward",
        "layergraph_adapters.internvl:_routed_attention",
        "layergraph_adapters.kit.idefics:patch_position_ids",
        "layergraph_adapters.kit.naflex:packed_forward",
        "layergraph_adapters.siglip2:Siglip2Plan.attend_packed",
        "layergraph_adapters.kit.device_tensors:_relative_positions",
    ),
    probes=(
        "idefics: whether the embeddings round fractional coordinates to the pixels' dtype, "
        "read from the embeddings' own forward on a probe mask",
    ),
    tests=(
        "tests/test_siglip_clip_adapters.py",
        "tests/test_internvl_adapter.py",
        "tests/test_auto_adapter.py",
        "tests/test_versions.py",
        "tests/test_tower_families.py",
        "tests/test_example_capturable.py",
        "tests/test_coverage.py",
        "tests/test_families_benchmark.py",
        "tests/test_siglip2_adapter.py",
        "tests/test_grid_positions.py",
        "tests/test_audio_encoders.py",
        "tests/test_waveform_encoders.py",
        "tests/test_qformer.py",
        "tests/test_video_towers.py",
        "tests/test_beit.py",
        "tests/test_multi_tower.py",
    ),
)
"""The fixed-resolution families of :data:`layergraph_adapters.towers.TOWERS`, InternVL's,
SigLIP2 NaFlex's and the audio encoders' (:mod:`layergraph_adapters.audio`)."""


def support_table() -> dict[str, Support]:
    """Every family's support, by name: :data:`TRANSFORMER_TOWERS`, then those of the family
    records the plugins of the entry-point group ``layergraph`` hold
    (:func:`~layergraph_adapters.kit.family_record.family_records`) and the supports their
    modules hold. The release table CI reads (:func:`floors`)."""
    found = {TRANSFORMER_TOWERS.name: TRANSFORMER_TOWERS}
    for record in family_records():
        if record.support is not None:
            found.setdefault(record.support.name, record.support)
    for point in entry_points(group="layergraph"):
        try:
            plugin = point.load()
        except Exception:  # a broken plugin names no family here
            continue
        for value in vars(plugin).values():
            if isinstance(value, Support):
                found.setdefault(value.name, value)
    return found


_RANGES_MOVED = {
    "QWEN2_VL_CHECKED": "qwen2_vl",
    "GLM_VISION_CHECKED": "glm vision",
    "QWEN3_5_VISION_CHECKED": "qwen3.5 vision",
    "QWEN3_VL_MOE_VISION_CHECKED": "qwen3-vl-moe vision",
    "PIXTRAL_CHECKED": "pixtral",
}
"""The packed families' ranges that were constants here, by the support they are now part of."""


def __getattr__(name: str) -> object:
    """``SUPPORT`` (:func:`support_table`), and the packed families' old range constants with
    a ``LayergraphDeprecationWarning`` (they go in 0.3)."""
    if name == "SUPPORT":
        return support_table()
    if name in _RANGES_MOVED:
        family = _RANGES_MOVED[name]
        warn(
            f"layergraph_adapters.kit.versions.{name} is the {family} family's "
            f"support.checked (kit.versions.support_table()['{family}'], or its record's "
            "support) since layergraph 0.2.0; the constant goes in 0.3",
            LayergraphDeprecationWarning,
        )
        return support_table()[family].checked
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def floors() -> dict[str, list[str]]:
    """The test files to run with each family's oldest release, by release, oldest first."""
    by_release: dict[str, list[str]] = {}
    for support in support_table().values():
        files = by_release.setdefault(support.floor, [])
        files += [test for test in support.tests if test not in files]
    return dict(sorted(by_release.items(), key=lambda item: tuple(map(int, item[0].split(".")))))


if __name__ == "__main__":  # for CI: one line per release, "RELEASE TEST_FILE ..."
    from layergraph_adapters.kit import versions  # the module the plugins import, not __main__

    for release, files in versions.floors().items():
        sys.stdout.write(" ".join([release, *files]) + "\n")
