"""Whisper's and Qwen2-Audio's encoders: recognised by ``adapter="auto"`` alone and inside
their models, served from graphs on the faithful replay, equal to eager; ``generate`` and the
ASR pipeline run the encoder from the graphs and give the eager answer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import layergraph
from layergraph.testing import SimulatedGraphs

MEL_BINS = 8
POSITIONS = 50
FRAMES = 2 * POSITIONS
ENCODER = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    num_mel_bins=MEL_BINS,
    max_source_positions=POSITIONS,
)
TOLERANCE = dict(rtol=0, atol=0)
"""The faithful replay runs the captured region's own kernels: equal, not close."""


def whisper_config(vocab: int = 100, encoder_layers: int = 2) -> transformers.WhisperConfig:
    return transformers.WhisperConfig(
        **{**ENCODER, "encoder_layers": encoder_layers},
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        vocab_size=vocab,
        max_target_positions=32,
        pad_token_id=vocab - 3,
        bos_token_id=vocab - 3,
        eos_token_id=vocab - 3,
        decoder_start_token_id=vocab - 2,
    )


def features(clips: int, seed: int) -> torch.Tensor:
    return torch.randn(clips, MEL_BINS, FRAMES, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("encoder_layers", [2, 4], ids=["whisper", "distil-whisper-like"])
def test_whisper_encoder_alone_equals_eager_per_batch(encoder_layers: int) -> None:
    torch.manual_seed(0)
    encoder = transformers.WhisperModel(whisper_config(encoder_layers=encoder_layers)).encoder
    encoder.eval()
    graphed = layergraph.wrap(encoder, backend=SimulatedGraphs())
    assert graphed.adapter.name == "whisper"
    with torch.inference_mode():
        for clips, seed in ((1, 1), (3, 2), (3, 3)):
            x = features(clips, seed)
            with graphed.original() as original:
                want = original(x)
            got = graphed(x)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **TOLERANCE)
    assert graphed.stats.replays == 3
    assert sorted(key.batch for key in graphed.keys) == [1, 3]
    assert {str(key.sequence) for key in graphed.keys} == {"50 tokens (100 mel frames)"}


def test_generate_runs_the_encoder_from_the_graphs_with_the_eager_scores() -> None:
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(whisper_config()).eval()
    x = features(2, 4)
    settings = dict(max_new_tokens=5, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        want = model.generate(x, **settings)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = model.generate(x, **settings)
    assert graphed.adapter.name == "whisper"
    assert graphed.stats.replays == 1
    assert torch.equal(got.sequences, want.sequences)
    for mine, theirs in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(mine, theirs, **TOLERANCE)
    assert not torch.equal(want.scores[0][0], want.scores[0][1]), "scores must depend on audio"


def test_wrong_features_are_refused_by_name_and_nothing_is_captured() -> None:
    encoder = transformers.WhisperModel(whisper_config()).encoder.eval()
    graphed = layergraph.wrap(encoder, backend=SimulatedGraphs())
    with torch.inference_mode():
        with pytest.raises(ValueError, match="100 frames, got 60; pad or cut"):
            graphed(torch.randn(1, MEL_BINS, 60))
        with pytest.raises(ValueError, match="expected 8 mel bins, got 4"):
            graphed(torch.randn(1, 4, FRAMES))
        with pytest.raises(ValueError, match=r"\[clips, mel bins, frames\]"):
            graphed(torch.randn(MEL_BINS, FRAMES))
    assert graphed.keys == [] and graphed.stats.captures == 0


def test_whisper_audio_classification_reads_its_encoder_from_the_graphs() -> None:
    config = whisper_config()
    config.num_labels = 3
    torch.manual_seed(0)
    model = transformers.WhisperForAudioClassification(config).eval()
    x = features(2, 5)
    with torch.inference_mode():
        want = model(x).logits
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = model(x).logits
    torch.testing.assert_close(got, want, **TOLERANCE)
    assert graphed.stats.replays == 1


def _tiny_tokenizer(folder: Path) -> transformers.WhisperTokenizer:
    """A byte-level Whisper tokenizer with no merges, written to ``folder``: offline."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    for special in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.WhisperTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt")
    )
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def test_the_asr_pipeline_gives_the_same_text_with_the_encoder_replayed(tmp_path: Path) -> None:
    tokenizer = _tiny_tokenizer(tmp_path)
    extractor = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=1)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(whisper_config(len(tokenizer))).eval()
    model.generation_config.max_new_tokens = 6
    asr = transformers.pipeline(
        "automatic-speech-recognition",
        model=model,
        tokenizer=tokenizer,
        feature_extractor=extractor,
    )
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (8000, 12000, 16000)]
    settings = dict(batch_size=3, generate_kwargs=dict(max_new_tokens=6))
    want = asr(clips, **settings)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    got = asr(clips, **settings)
    assert got == want
    assert graphed.stats.replays == 1 and not graphed.stats.eager_calls


def qwen2_audio() -> transformers.Qwen2AudioForConditionalGeneration:
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=120,
    )
    config = transformers.Qwen2AudioConfig(
        audio_config=ENCODER, text_config=text, audio_token_index=100
    )
    torch.manual_seed(0)
    return transformers.Qwen2AudioForConditionalGeneration(config).eval()


def _audio_inputs(model: torch.nn.Module, x: torch.Tensor, short: int) -> dict[str, torch.Tensor]:
    """A call of ``model`` on clips ``x``, the second ``short`` frames long (masked after)."""
    mask = torch.ones(x.shape[0], FRAMES, dtype=torch.long)
    mask[1, short:] = 0
    tower = getattr(model, "audio_tower", None) or model.model.audio_tower  # 5.6: at the top
    _, lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
    ids = torch.full((x.shape[0], int(lengths.max()) + 3), 5)
    for row, length in enumerate(lengths.tolist()):
        ids[row, 1 : 1 + length] = 100
    return dict(input_ids=ids, input_features=x, feature_attention_mask=mask)


def test_qwen2_audio_vlm_reads_its_masked_encoder_from_the_graphs() -> None:
    model = qwen2_audio()
    x = features(2, 6)
    calls = [_audio_inputs(model, x, short) for short in (60, 80)]
    with torch.inference_mode():
        want = [model(**call).logits for call in calls]
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = [model(**call).logits for call in calls]
    assert graphed.adapter.name == "qwen2_audio"
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, **TOLERANCE)
    assert not torch.allclose(want[0][1, :4], want[1][1, :4]), "the mask must reach the encoder"
    assert graphed.stats.replays == 2 and graphed.stats.graphs == 1
