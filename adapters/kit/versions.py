"""The transformers releases the transformers adapters were checked against.

These adapters (InternVL's and every family of :data:`layergraph_adapters.towers.TOWERS`)
follow transformers' own code: the attention forward of CLIP-style layers
(:func:`layergraph_adapters.kit.fused_qkv.fused_attention_forward`), InternViT's attention (the
routed forward of :mod:`layergraph_adapters.internvl`), and where a model keeps its tower,
layers and embeddings (each family's :class:`~layergraph_adapters.kit.tower_specs.TowerSpec`).
Another release may change that code, and a copy that no longer matches it computes something
else without failing, so the plans refuse transformers outside the checked range
(:func:`require_transformers`). :data:`SUPPORT` is the one table of it: per family, the range,
the functions that copy transformers' code, what is read from the release's behaviour rather
than its version, and the tests that compare the copies with transformers' own forward, which
CI runs with each family's oldest release (:func:`floors`) as well as the newest.
The qwen2_vl adapter needs a narrower range (:data:`QWEN2_VL_CHECKED`, and
:data:`GLM_VISION_CHECKED` for the GLM towers it serves, :data:`QWEN3_5_VISION_CHECKED` for
Qwen3.5's, :data:`QWEN3_VL_MOE_VISION_CHECKED` for Qwen3-VL-MoE's), and so does the pixtral
adapter (:data:`PIXTRAL_CHECKED`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from layergraph import AdapterMismatch

__all__ = [
    "GLM_VISION_CHECKED",
    "PIXTRAL_CHECKED",
    "QWEN2_VL_CHECKED",
    "QWEN3_5_VISION_CHECKED",
    "QWEN3_VL_MOE_VISION_CHECKED",
    "SUPPORT",
    "TRANSFORMERS_CHECKED",
    "UNCHECKED_VARIABLE",
    "Support",
    "floors",
    "require_transformers",
]

TRANSFORMERS_CHECKED = ">=5.6.0,<5.25"
"""The transformers releases the adapters serve, as a version specifier: 5.6.0 to 5.24.x.

The adapters' CPU tests, and the coverage test, pass with 5.6.0, 5.8.1, 5.12.1, 5.17.0 and
5.24.0. With 5.5.4, graphs that stop at a feature layer (LLaVA's, VipLLaVA's) do not match the
model; with 5.0.0 the fused q/k/v attention fails too. ``pyproject.toml``'s ``transformers``
extra asks for the same range."""

QWEN2_VL_CHECKED = ">=5.17.0,<5.25"
"""The transformers releases the qwen2_vl adapter serves: 5.17.0 to 5.24.x. Its graphs hand the
Qwen vision towers precomputed boundaries, positions and windows (``cu_seqlens``,
``window_index``, ``interp_indices`` ...), which their forwards take from 5.17 on, computed by
``transformers.vision_utils``, which older releases lack. Its CPU tests pass with 5.17.0 and
5.24.0."""

GLM_VISION_CHECKED = ">=5.17.0,<5.25"
"""The transformers releases whose GLM vision towers (GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-OCR,
GLM-5-Next) the qwen2_vl adapter serves: 5.17.0 to 5.24.x; its CPU tests pass with 5.17.0 and
5.24.0 (GLM-OCR and GLM-5-Next come with later releases than 5.17). Their
forwards take the same precomputed arguments as the Qwen towers'; GLM-4.1V's also reads
``grid_thw``'s rows in its position embeddings, which the graphs are given in a buffer."""

QWEN3_5_VISION_CHECKED = ">=5.17.0,<5.25"
"""The transformers releases whose Qwen3.5 vision towers (``Qwen3_5VisionModel``,
``Qwen3_5MoeVisionModel``) the qwen2_vl adapter serves: 5.17.0 to 5.24.x; its CPU tests pass
with 5.17.0 and 5.24.0. Their forwards are Qwen3-VL's without the deep-stack mergers, taking
the same precomputed arguments, and return ``BaseModelOutputWithPooling``."""

QWEN3_VL_MOE_VISION_CHECKED = ">=5.17.0,<5.25"
"""The transformers releases whose Qwen3-VL-MoE vision tower (``Qwen3VLMoeVisionModel``) the
qwen2_vl adapter serves: 5.17.0 to 5.24.x; its CPU tests pass with 5.17.0 and 5.24.0. In both,
its modeling code is Qwen3-VL's tower renamed (rotary embedding, attention, MLP, block, patch
embedding, mergers and forward, deep-stack features included), and Qwen3-VL-MoE's VLM calls it
as Qwen3-VL's does."""

PIXTRAL_CHECKED = ">=5.17.0,<5.25"
"""The transformers releases the pixtral adapter serves: 5.17.0 to 5.24.x; its CPU tests pass
with 5.17.0 and 5.24.0. Its graphs compute the rotary embeddings by the tower's own module from
each patch's (row, column), the positions ``PixtralVisionRotaryEmbedding`` takes in both, and
route ``PixtralAttention``, which both write alike. The releases differ in the tower's output
class (``BaseModelOutput`` with 5.17, ``BaseModelOutputWithPooling`` with 5.24), which the graphs'
outputs take from a call of the tower's forward, and in what ``output_hidden_states``
selects: with 5.24 an index or a list of indices of ``hidden_states``, with 5.17 all of them
for any true value but a list, which the graphs leave to the tower itself. LLaVA and Mistral 3
ask for all of them with 5.17 and for their ``vision_feature_layer`` with 5.24; LightOnOCR asks
for none."""

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


@dataclass(frozen=True)
class Support:
    """What one family of transformers towers is served with: the releases, the functions of
    layergraph that follow transformers' code for it, what is read from the release at run time
    rather than from its version, and the tests that check it (which CI runs with the oldest
    release of the range, and the newest)."""

    checked: str
    """The transformers releases served, as a version specifier."""
    copies: tuple[str, ...]
    """The functions that compute what transformers' own code computes for this family
    (``module:qualified name``): each is compared with transformers' forward by its tests."""
    probes: tuple[str, ...]
    """What the family's plan reads from the installed release's behaviour or declarations
    rather than its version."""
    tests: tuple[str, ...]
    """The test files that check the family against transformers' own forward."""

    @property
    def floor(self) -> str:
        """The oldest release of :attr:`checked` (its ``>=`` bound)."""
        found = re.search(r">=\s*([0-9][0-9.]*)", self.checked)
        if found is None:
            raise ValueError(f"{self.checked!r} names no oldest release")
        return found.group(1)


SUPPORT: dict[str, Support] = {
    "transformers towers": Support(
        TRANSFORMERS_CHECKED,
        copies=(
            "layergraph_adapters.kit.fused_qkv:fused_attention_forward",
            "layergraph_adapters.internvl:_routed_attention",
            "layergraph_adapters.kit.idefics:patch_position_ids",
            "layergraph_adapters.kit.naflex:packed_forward",
            "layergraph_adapters.siglip2:Siglip2Plan.attend_packed",
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
        ),
    ),
    "qwen2_vl": Support(
        QWEN2_VL_CHECKED,
        copies=("layergraph_adapters.qwen2_vl:Qwen2VLPlan.attend_packed",),
        probes=(),
        tests=(
            "tests/test_qwen2_vl_adapter.py",
            "tests/test_qwen2_vl_eager.py",
            "tests/test_qwen2_vl_fused_norm.py",
            "tests/test_packed_attention_plugins.py",
        ),
    ),
    "glm vision": Support(
        GLM_VISION_CHECKED,
        copies=("layergraph_adapters.qwen2_vl:Qwen2VLPlan.attend_packed",),
        probes=(),
        tests=("tests/test_glm4v_adapter.py",),
    ),
    "qwen3.5 vision": Support(
        QWEN3_5_VISION_CHECKED,
        copies=("layergraph_adapters.qwen2_vl:Qwen2VLPlan.attend_packed",),
        probes=(),
        tests=("tests/test_qwen3_5_adapter.py",),
    ),
    "qwen3-vl-moe vision": Support(
        QWEN3_VL_MOE_VISION_CHECKED,
        copies=("layergraph_adapters.qwen2_vl:Qwen2VLPlan.attend_packed",),
        probes=(),
        tests=("tests/test_qwen3_vl_moe_adapter.py",),
    ),
    "pixtral": Support(
        PIXTRAL_CHECKED,
        copies=(
            "layergraph_adapters.pixtral:PixtralPlan.packed_forward",
            "layergraph_adapters.pixtral:PixtralPlan.attend_packed",
        ),
        probes=(
            "the output class, from one call of the tower's forward on a one-patch image",
            "whether output_hidden_states selects by index "
            "(transformers.utils.output_capturing.selected_hidden_states)",
        ),
        tests=("tests/test_pixtral_adapter.py",),
    ),
}
"""Every family of transformers towers layergraph serves, by the name its docs use: one table
that the plans' checks (:func:`require_transformers`, given a family's ``checked``) and CI
(:func:`floors`) read."""


def floors() -> dict[str, list[str]]:
    """The test files to run with each family's oldest release, by release, oldest first."""
    by_release: dict[str, list[str]] = {}
    for support in SUPPORT.values():
        files = by_release.setdefault(support.floor, [])
        files += [test for test in support.tests if test not in files]
    return dict(sorted(by_release.items(), key=lambda item: tuple(map(int, item[0].split(".")))))


if __name__ == "__main__":  # for CI: one line per release, "RELEASE TEST_FILE ..."
    for release, files in floors().items():
        sys.stdout.write(" ".join([release, *files]) + "\n")
