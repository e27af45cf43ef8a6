"""The Q-Former of BLIP-2 and InstructBLIP: recognised by ``adapter="auto"`` alone and served as
the second stack of its model beside the vision tower, under one wrapper; on the faithful
replay, equal to eager on fresh random inputs (a two-layer Q-Former, so that a cross-attention
layer and a query-only one are both captured)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import BLIP_VLMS, IMAGE, IMAGE_TOKEN, images

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
QFORMER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    encoder_hidden_size=48,
    vocab_size=100,
)
KINDS = {"blip-2": "Blip2QFormerConfig", "instructblip": "InstructBlipQFormerConfig"}


def qformer(kind: str) -> torch.nn.Module:
    config = getattr(transformers, KINDS[kind])(**QFORMER)
    model_class = {
        "blip-2": transformers.Blip2QFormerModel,
        "instructblip": transformers.InstructBlipQFormerModel,
    }[kind]
    torch.manual_seed(0)
    return model_class(config).eval()


def inputs(kind: str, batch: int, seed: int, text: int = 5) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    given: dict[str, Any] = {
        "query_embeds": torch.randn(batch, 4, 64, generator=generator),
        "encoder_hidden_states": torch.randn(batch, 17, 48, generator=generator),
        "encoder_attention_mask": torch.ones(batch, 17, dtype=torch.long),
    }
    if kind == "instructblip":
        given["input_ids"] = torch.randint(1, 100, (batch, text), generator=generator)
        given["attention_mask"] = torch.ones(batch, 4 + text, dtype=torch.long)  # queries, text
    return given


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_qformer_alone_answers_as_eager_per_batch_and_instruction(kind: str) -> None:
    model = qformer(kind)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "qformer"
    calls = [inputs(kind, 1, 0), inputs(kind, 3, 1), inputs(kind, 2, 2, text=7)]
    with torch.inference_mode():
        for call in calls:
            got = graphed(**call)
            with graphed.original():
                want = model(**call)
            assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
    assert graphed.stats.replays == len(calls) and graphed.stats.eager_total == 0
    sequences = {str(key.sequence) for key in graphed.keys}
    text = ", 7 instruction tokens" if kind == "instructblip" else ""
    assert "4 queries over 17 image tokens" + text in sequences


@pytest.mark.parametrize(
    "name", ["Blip2ForConditionalGeneration", "InstructBlipForConditionalGeneration"]
)
def test_the_models_generate_reads_both_stacks_from_the_graphs(name: str) -> None:
    tiny = BLIP_VLMS[name]
    model = tiny.build()
    generator = torch.Generator().manual_seed(3)
    prompt = {
        "pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=generator),
        "input_ids": torch.tensor([[IMAGE_TOKEN] * 4 + [1, 2, 3]] * 2),  # the queries' places
    }
    if name.startswith("InstructBlip"):
        prompt["qformer_input_ids"] = torch.randint(1, 50, (2, 6), generator=generator)
    settings = dict(max_new_tokens=3, do_sample=False)
    with torch.inference_mode():
        want = model.generate(**prompt, **settings)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = model.generate(**prompt, **settings)
    assert torch.equal(got, want)
    adapters = {path: tower.adapter.name for path, tower in graphed.towers.items()}
    assert adapters == {"vision_model": "blip", "qformer": "qformer"}
    assert all(stats.replays == 1 for stats in graphed.stats.values())


def test_bad_queries_are_refused_by_name_before_any_capture() -> None:
    graphed = layergraph.wrap(qformer("blip-2"), backend=SimulatedGraphs())
    with torch.inference_mode():
        with pytest.raises(ValueError, match="query_embeds of width 64"):
            graphed(query_embeds=torch.randn(1, 4, 32), encoder_hidden_states=images(1))
        with pytest.raises(ValueError, match="width 48"):
            graphed(query_embeds=torch.randn(1, 4, 64), encoder_hidden_states=torch.randn(1, 3, 8))
    assert graphed.stats.graphs == 0
