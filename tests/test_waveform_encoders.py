"""wav2vec 2.0, HuBERT and WavLM: recognised by ``adapter="auto"`` alone and inside their models
with a head, served from graphs on the faithful replay (which refuses what a CUDA capture
refuses: the encoders' boolean-mask assignment is computed as a ``masked_fill``), equal to
eager on fresh random audio; calls of the models that normalise each frame padded to a few
lengths, the others at their exact lengths."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
"""Padded calls attend with a mask, exact ones without: equal up to rounding."""
ENCODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 4),
    conv_kernel=(10, 4),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2,
    vocab_size=12,
)
"""One frame per 20 samples."""
PER_FRAME = dict(feat_extract_norm="layer", do_stable_layer_norm=True)
"""wav2vec 2.0 large, HuBERT large, WavLM: each frame normalised on its own."""
PER_CLIP = dict(feat_extract_norm="group", do_stable_layer_norm=False)
"""wav2vec 2.0 base, HuBERT base: the first convolution normalised over the whole clip."""
FAMILIES = {
    "wav2vec2": ("Wav2Vec2Model", "Wav2Vec2ForCTC"),
    "hubert": ("HubertModel", "HubertForCTC"),
    "wavlm": ("WavLMModel", "WavLMForCTC"),
}


def model(name: str, **settings: Any) -> torch.nn.Module:
    cls = getattr(transformers, name)
    torch.manual_seed(0)
    return cls(cls.config_class(**ENCODER, **settings)).eval()


def audio(clips: int, samples: int, seed: int) -> torch.Tensor:
    return torch.randn(clips, samples, generator=torch.Generator().manual_seed(seed))


def answer(out: Any) -> torch.Tensor:
    return out["logits"] if "logits" in out else out["last_hidden_state"]


def served_equal(graphed: Any, original: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    with torch.inference_mode():
        got = graphed(*args, **kwargs)
        with graphed.original():
            want = original(*args, **kwargs)
    assert type(got) is type(want) and list(got.keys()) == list(want.keys())
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert relative_error(got[name], want[name]) <= TOLERANCE, name


@pytest.mark.parametrize("name", [name for pair in FAMILIES.values() for name in pair])
def test_calls_of_many_lengths_share_padded_graphs_and_answer_as_eager(name: str) -> None:
    wrapped = model(name, **PER_FRAME)
    graphed = layergraph.wrap(wrapped, backend=SimulatedGraphs(), length_step=200)
    assert graphed.adapter.name in FAMILIES
    rng = random.Random(2)
    lengths = [rng.randint(100, 1000) for _ in range(8)]
    for seed, samples in enumerate(lengths):
        served_equal(graphed, wrapped, audio(rng.randint(1, 3), samples, seed))
    padded = {-(-samples // 200) * 200 for samples in lengths}
    assert {key.sequence.samples for key in graphed.keys} == padded
    assert graphed.stats.eager_total == 0 and graphed.stats.replays == len(lengths)


@pytest.mark.parametrize("name", ["Wav2Vec2Model", "HubertForCTC"])
def test_models_that_normalise_over_the_clip_get_exact_lengths(name: str) -> None:
    wrapped = model(name, **PER_CLIP)
    graphed = layergraph.wrap(wrapped, backend=SimulatedGraphs(), length_step=200)
    for seed, samples in enumerate((333, 400, 999)):
        served_equal(graphed, wrapped, audio(2, samples, seed))
    assert {key.sequence.samples for key in graphed.keys} == {333, 400, 999}
    assert graphed.stats.eager_total == 0


def test_a_batch_of_clips_padded_by_their_extractor_answers_as_eager() -> None:
    wrapped = model("Wav2Vec2ForCTC", **PER_FRAME)
    graphed = layergraph.wrap(wrapped, backend=SimulatedGraphs(), length_step=256)
    values = audio(3, 700, seed=4)
    mask = torch.ones(3, 700, dtype=torch.long)
    for row, real in enumerate((700, 420, 150)):
        values[row, real:] = 0
        mask[row, real:] = 0
    served_equal(graphed, wrapped, values, attention_mask=mask)
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0


def test_exact_lengths_are_the_default() -> None:
    wrapped = model("WavLMModel", **PER_FRAME)
    graphed = layergraph.wrap(wrapped, backend=SimulatedGraphs())
    for seed, samples in enumerate((300, 301)):
        served_equal(graphed, wrapped, audio(1, samples, seed))
    assert {key.sequence.samples for key in graphed.keys} == {300, 301}


def test_the_encoders_masked_assignment_is_what_a_capture_refuses_without_the_rewrite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without :class:`MaskedAssignment`, the faithful replay refuses the padded call's
    capture, as a CUDA capture does; with it, the call is served."""
    from layergraph_adapters.kit import waveform

    class Unchanged(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(waveform, "MaskedAssignment", Unchanged)
    wrapped = model("Wav2Vec2Model", **PER_FRAME)
    graphed = layergraph.wrap(wrapped, backend=SimulatedGraphs(), length_step=200)
    with torch.inference_mode():
        graphed(audio(1, 333, seed=1))
    assert graphed.stats.failed_captures >= 1


def test_bad_input_is_refused_by_name_before_any_capture() -> None:
    graphed = layergraph.wrap(model("Wav2Vec2Model", **PER_FRAME), backend=SimulatedGraphs())
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"\[clips, samples\]"):
            graphed(torch.randn(1, 2, 400))
        with pytest.raises(ValueError, match="takes audio samples"):
            graphed(torch.ones(1, 400, dtype=torch.long))
        with pytest.raises(ValueError, match="attention_mask"):
            graphed(torch.randn(2, 400), attention_mask=torch.ones(2, 300, dtype=torch.long))
        with pytest.raises(ValueError, match="make no frame"):
            graphed(torch.randn(1, 5))
    assert graphed.stats.graphs == 0 and graphed.stats.replays == 0
    with pytest.raises(ValueError, match="length_step"):
        layergraph.wrap(model("Wav2Vec2Model"), length_step=0)
