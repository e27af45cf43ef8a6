"""Coverage: every transformers class with a vision tower is served by layergraph, or says why not.

The walk and the table are in :mod:`coverage_table`. Served classes are built tiny and wrapped with
``adapter="auto"`` among layergraph's own plugins (no third party's), and must be recognised by
their family's adapter and answer as the unwrapped model does: float32, the same kernels on
chunked batches, so 1e-4 relative error, with graphs simulated on the CPU. Unserved classes
are built on the meta device from their default configuration and must not be recognised, so
that a family layergraph comes to serve moves to the served table with a tiny model. A class a
new transformers release adds fails :func:`test_every_walked_class_is_served_or_has_a_reason`
by name.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from coverage_table import (  # noqa: E402
    AUDIO_SERVED,
    PACKED_SERVED,
    SERVED,
    SEVERAL_KINDS,
    TOWERS_IN_PLACE,
    UNSERVED,
    meta_model,
    served_stats,
    walked_classes,
)

import layergraph  # noqa: E402
from layergraph import plugins  # noqa: E402
from layergraph.testing import SimulatedGraphs  # noqa: E402
from layergraph.validation import relative_error  # noqa: E402

TOLERANCE = 1e-4
ROOT = Path(__file__).resolve().parent.parent


def towers_of(model: torch.nn.Module, registry: plugins.AdapterRegistry) -> dict[str, str]:
    """The towers ``wrap`` finds in ``model`` with ``registry``'s adapters."""
    from layergraph.multi_tower import find_towers

    def inside_any_model(name: str) -> bool:
        return getattr(registry.factory(name), "inside_any_model", True)

    return find_towers(model, registry.dedicated, inside_any_model)


@pytest.fixture(scope="module")
def own_plugins() -> Iterator[plugins.AdapterRegistry]:
    """The registry of layergraph's own plugins alone, used by ``wrap`` in these tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(plugins.DISABLE_ENV, "1")
        plugins.reset_registry()
        yield plugins.get_registry()
    plugins.reset_registry()


def test_every_walked_class_is_served_or_has_a_reason() -> None:
    unlisted = {
        name: model_type
        for name, model_type in walked_classes().items()
        if name not in SERVED
        and name not in PACKED_SERVED
        and name not in TOWERS_IN_PLACE
        and name not in UNSERVED
    }
    assert not unlisted, (
        f"transformers {transformers.__version__} has classes with a vision tower that "
        f"layergraph neither serves nor lists: "
        + ", ".join(f"{name} (model type {kind})" for name, kind in sorted(unlisted.items()))
        + ". Serve each (a tiny model in tests/tiny_models.py) or give the reason in "
        "tests/coverage_table.py's UNSERVED"
    )


@pytest.mark.parametrize("name", sorted(TOWERS_IN_PLACE))
def test_a_class_of_towers_in_place_has_each_found_with_its_adapter(
    name: str, own_plugins: plugins.AdapterRegistry
) -> None:
    model = meta_model(name)
    if model is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if isinstance(model, Exception):
        pytest.skip(f"{name} does not build from its default configuration: {model}")
    assert own_plugins.dedicated(model) is None
    assert towers_of(model, own_plugins) == TOWERS_IN_PLACE[name]


@pytest.mark.parametrize("name", sorted(AUDIO_SERVED))
def test_an_audio_class_is_recognised_by_its_adapter(
    name: str, own_plugins: plugins.AdapterRegistry
) -> None:
    model = meta_model(name)
    assert isinstance(model, torch.nn.Module), model
    assert own_plugins.recognize(model) == AUDIO_SERVED[name]


def test_a_class_is_served_or_unserved_not_both() -> None:
    assert not SERVED.keys() & UNSERVED.keys()
    assert not PACKED_SERVED.keys() & (SERVED.keys() | UNSERVED.keys())
    assert not TOWERS_IN_PLACE.keys() & (SERVED.keys() | PACKED_SERVED.keys() | UNSERVED.keys())


def packed_tiny(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny ``name`` from its adapter's own tests' builders, and the arguments of one call
    of its ``get_image_features``: images of several sizes."""
    if name.startswith("Glm"):
        import test_glm4v_adapter as glm

        pixels, grid = glm.call([(1, 4, 6), (1, 2, 2)])
        return glm.vlm(name), {"pixel_values": pixels, "image_grid_thw": grid}
    if "Omni" in name:
        import test_qwen_omni_adapter as omni

        pixels, grid = omni.call([(1, 4, 6), (1, 2, 2)])
        return omni.thinker(name), {"pixel_values": pixels, "image_grid_thw": grid}
    if name.startswith("Qwen3_5"):
        import test_qwen3_5_adapter as qwen3_5

        pixels, grid = qwen3_5.call([(1, 4, 6), (1, 2, 2)])
        return qwen3_5.vlm(name), {"pixel_values": pixels, "image_grid_thw": grid}
    if name.startswith("Qwen3VLMoe"):
        import test_qwen3_vl_moe_adapter as qwen3_vl_moe

        pixels, grid = qwen3_vl_moe.call([(1, 4, 6), (1, 2, 2)])
        return qwen3_vl_moe.vlm(), {"pixel_values": pixels, "image_grid_thw": grid}
    if PACKED_SERVED[name] == "qwen2_vl":
        import test_qwen2_vl_adapter as qwen

        if name.startswith("Qwen3VL"):
            model = qwen.qwen3_vlm()
        else:
            model = qwen.vlm("qwen2_vl" if name.startswith("Qwen2VL") else "qwen2_5_vl")
        pixels, grid = qwen.call([(1, 4, 6), (1, 2, 2)])
        return model, {"pixel_values": pixels, "image_grid_thw": grid}
    if PACKED_SERVED[name] == "pixtral":
        import test_pixtral_adapter as pixtral

        family = {
            "LightOnOcrForConditionalGeneration": "lighton_ocr",
            "Mistral3ForConditionalGeneration": "mistral3",
            "MistralLarge4ForConditionalGeneration": "mistral_large4",
        }[name]
        return pixtral.vlm(family), pixtral.call([(8, 12), (4, 4), (12, 4)])
    import test_siglip2_adapter as siglip2

    if name == "Siglip2Model":
        torch.manual_seed(0)
        text = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        config = transformers.Siglip2Config(text_config=text, vision_config=siglip2.VISION)
        model = siglip2.sharpen(transformers.Siglip2Model(config).eval())
        return model, siglip2.call([(3, 5), (6, 2), (2, 2)], patches=16)
    return siglip2.lfm2_vl(), siglip2.call([(4, 6), (2, 2)], patches=30)


@pytest.mark.parametrize("name", sorted(PACKED_SERVED))
def test_a_packed_served_class_is_recognised_and_its_image_features_answer_as_eager(
    name: str, own_plugins: plugins.AdapterRegistry
) -> None:
    """Packed towers take images of their own sizes, not a batch of equal ones: one call of
    several sizes, through the graphs, against the unwrapped model."""
    model, inputs = packed_tiny(name)
    if name not in SEVERAL_KINDS:
        assert own_plugins.recognize(model) == PACKED_SERVED[name]
    with torch.inference_mode():
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
        if name in SEVERAL_KINDS:
            towers = {path.rsplit(".", 1)[-1]: t.adapter.name for path, t in graphed.towers.items()}
            assert towers == SEVERAL_KINDS[name]
        got = model.get_image_features(**inputs).pooler_output  # graphed in place
        with graphed.original():
            want = model.get_image_features(**inputs).pooler_output
    for have, expected in zip(got, want):
        assert have.shape == expected.shape
        assert relative_error(have, expected) <= TOLERANCE
    stats = served_stats(graphed, PACKED_SERVED[name])
    assert stats.replays == 1 and stats.eager_total == 0


@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_served_class_is_recognised_and_answers_as_eager(
    name: str, own_plugins: plugins.AdapterRegistry
) -> None:
    tiny = SERVED[name]
    model = tiny.build()
    batches = (1, 3)
    with torch.inference_mode():
        expected = [tiny.answer(model, batch, seed) for seed, batch in enumerate(batches)]
        graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[1, 2])
        got = [tiny.answer(graphed, batch, seed) for seed, batch in enumerate(batches)]
    if name in SEVERAL_KINDS:
        towers = {path.rsplit(".", 1)[-1]: t.adapter.name for path, t in graphed.towers.items()}
        assert towers == SEVERAL_KINDS[name]
    else:
        assert graphed.adapter.name == tiny.adapter
    for batch, have, want in zip(batches, got, expected):
        assert have.shape == want.shape
        assert relative_error(have, want) <= TOLERANCE, batch
    stats = served_stats(graphed, tiny.adapter)
    assert stats.split_calls == 1 and stats.replays > len(batches) and stats.eager_total == 0


@pytest.mark.parametrize("name", sorted(UNSERVED))
def test_an_unserved_class_is_not_recognised(
    name: str, own_plugins: plugins.AdapterRegistry
) -> None:
    model = meta_model(name)
    if model is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if isinstance(model, Exception):
        pytest.skip(f"{name} does not build from its default configuration: {model}")
    assert towers_of(model, own_plugins) == {}, "wrap serves its towers in place"
    with pytest.raises(layergraph.UnknownAdapterError):
        adapter = own_plugins.recognize(model)
        pytest.fail(
            f"{name} is recognised by the {adapter} adapter now: move it from UNSERVED to "
            f"the served table, with a tiny model in tests/tiny_models.py"
        )


def test_the_docs_coverage_page_is_what_the_script_writes(
    own_plugins: plugins.AdapterRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/coverage.md is regenerated whenever the table changes (for the transformers the
    page was written with; other releases walk other classes)."""
    page = (ROOT / "docs" / "coverage.md").read_text()
    written_for = re.search(r"for transformers (\S+) from", page)
    assert written_for is not None, "the page says which transformers it was written for"
    if written_for.group(1) != transformers.__version__:
        pytest.skip(f"the page lists transformers {written_for.group(1)}'s classes")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import coverage_page

    results = coverage_page.latest_results()
    data = coverage_page.json.loads(results.read_text()) if results is not None else None
    assert coverage_page.render(data) == page, (
        "docs/coverage.md is stale: run python3 benchmarks/coverage_page.py"
    )
    sys.modules.pop("coverage_page", None)
