"""Audio encoders and several towers in one model on CUDA graphs: the same checks as on the
CPU's faithful replay (tests/test_audio_encoders.py, tests/test_multi_tower.py), against
eager on the GPU, float32 with TF32 off, 1e-3 relative error (a padded batch runs other
cuBLAS kernels than eager's)."""

from __future__ import annotations

import pytest
import torch
from test_audio_encoders import FRAMES, MEL_BINS, _audio_inputs, qwen2_audio, whisper_config
from test_multi_tower import video_llava
from tiny_models import images

import layergraph
from layergraph.multi_tower import GraphedTowers
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.cuda

TOLERANCE = 1e-3


@pytest.fixture(autouse=True)
def float32_matrix_products(float32_without_tf32: None) -> None:
    """Every test of this file in float32 without TF32."""


def test_whisper_generate_reads_the_encoder_from_cuda_graphs() -> None:
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(whisper_config()).cuda().eval()
    settings = dict(max_new_tokens=5, output_scores=True, return_dict_in_generate=True)
    calls = [torch.randn(clips, MEL_BINS, FRAMES, device="cuda") for clips in (1, 3, 2)]
    with torch.inference_mode():
        want = [model.generate(x, **settings) for x in calls]
        graphed = layergraph.wrap(model, compile_layers=False)
        got = [model.generate(x, **settings) for x in calls]
    for mine, theirs in zip(got, want, strict=True):
        for a, b in zip(mine.scores, theirs.scores, strict=True):
            assert relative_error(a, b) <= TOLERANCE
    assert graphed.stats.eager_total == 0 and graphed.stats.replays == 3
    graphed.unwrap()


def test_qwen2_audio_masks_reach_cuda_graphs() -> None:
    model = qwen2_audio().cuda()
    x = torch.randn(2, MEL_BINS, FRAMES)
    calls = [
        {name: value.cuda() for name, value in _audio_inputs(model, x, short).items()}
        for short in (60, 80)
    ]
    with torch.inference_mode():
        want = [model(**call).logits for call in calls]
        graphed = layergraph.wrap(model, compile_layers=False)
        got = [model(**call).logits for call in calls]
    for mine, theirs in zip(got, want, strict=True):
        assert relative_error(mine, theirs) <= TOLERANCE
    assert graphed.stats.replays == 2 and graphed.stats.graphs == 1
    graphed.unwrap()


def test_two_towers_share_one_cuda_pool_and_answer_as_eager() -> None:
    model = video_llava().cuda()
    pictures, frames = images(2).cuda(), images(1, 8).cuda()
    with torch.inference_mode():
        want = model.get_image_features(pictures).pooler_output
        want_video = model.model.get_video_features(frames).pooler_output
        graphed = layergraph.wrap(model, compile_layers=False)
        assert isinstance(graphed, GraphedTowers)
        for _ in range(2):
            got = model.get_image_features(pictures).pooler_output
            got_video = model.model.get_video_features(frames).pooler_output
            assert relative_error(got, want) <= TOLERANCE
            assert relative_error(got_video, want_video) <= TOLERANCE
    stats = graphed.stats
    assert all(stat.graphs == 1 and stat.eager_total == 0 for stat in stats.values())
    sizes = {stat.pool_bytes for stat in stats.values()}
    assert len(sizes) == 1 and sizes.pop() > 0, "one pool, reported by each tower"
    graphed.unwrap()


@pytest.mark.parametrize("kind", ["qwen2_5_omni", "qwen3_omni"])
def test_omni_audio_towers_answer_as_eager_on_cuda_graphs(kind: str) -> None:
    from test_omni_audio import clips, tower

    model = tower(kind).cuda()
    calls = [clips(frames, seed) for seed, frames in enumerate(([250, 40, 19], [5, 6], [420]))]
    with torch.inference_mode():
        want = [model(x.cuda(), feature_lens=lens.cuda()).last_hidden_state for x, lens in calls]
        graphed = layergraph.wrap(model, observe_calls=0, budget_step=16, compile_layers=False)
        for _ in range(2):
            for (x, lens), expected in zip(calls, want, strict=True):
                got = graphed(x.cuda(), feature_lens=lens.cuda()).last_hidden_state
                assert relative_error(got, expected) <= TOLERANCE
    assert graphed.stats.eager_total == 0 and graphed.stats.failed_captures == 0
    graphed.unwrap()


def test_padded_wav2vec2_calls_capture_and_answer_as_eager() -> None:
    """The encoder's boolean-mask assignment, computed as a masked_fill, captures on CUDA."""
    from test_waveform_encoders import PER_FRAME, audio, model

    wrapped = model("Wav2Vec2ForCTC", **PER_FRAME).cuda()
    calls = [audio(2, samples, seed).cuda() for seed, samples in enumerate((333, 390, 777))]
    with torch.inference_mode():
        want = [wrapped(x).logits for x in calls]
        graphed = layergraph.wrap(wrapped, length_step=400, compile_layers=False)
        for _ in range(2):
            for x, expected in zip(calls, want, strict=True):
                assert relative_error(wrapped(x).logits, expected) <= TOLERANCE
    assert graphed.stats.failed_captures == 0 and graphed.stats.eager_total == 0
    assert {key.sequence.samples for key in graphed.keys} == {400, 800}
    graphed.unwrap()
