"""The omni_audio adapter: Qwen2.5-Omni's and Qwen3-Omni's audio towers per token budget, alone
and inside their thinkers (whose vision encoders the qwen2_vl adapter serves under the same
wrapper). On the CPU through simulated graphs: every answer equals the unwrapped tower's on
fresh random clips within 1e-4 relative error (float32); attention is sharpened so that a wrong
chunk or window boundary, or a wrong padding of the convolutions, gives errors far above it."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from packed_helpers import skip_unless_served
from test_multi_tower import CountingPools

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")
skip_unless_served("qwen omni audio")
from test_qwen_omni_adapter import THINKERS, call, thinker  # noqa: E402

TOLERANCE = 1e-4
MEL_BINS = 8
AUDIO = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    num_mel_bins=MEL_BINS,
    output_dim=24,
)
QWEN2_5_AUDIO = dict(AUDIO, n_window=10, max_source_positions=50)
"""Chunks of 20 frames, 10 tokens each, pooled by two."""
QWEN3_AUDIO = dict(
    AUDIO,
    n_window=50,
    n_window_infer=200,
    max_source_positions=200,
    conv_chunksize=50,
    downsample_hidden_size=8,
)
"""Chunks of 100 frames, 13 tokens each; attention within windows of two chunks."""
KINDS = ("qwen2_5_omni", "qwen3_omni")


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its audio attention's q and k weights and its convolutions drawn at scale
    1, so that tokens of other chunks attended to, or frames past a chunk's padding read,
    change the outputs by far more than the tolerance."""
    for module in model.modules():
        if type(module).__name__.endswith("AudioAttention"):
            torch.nn.init.normal_(module.q_proj.weight, std=1.0)
            torch.nn.init.normal_(module.k_proj.weight, std=1.0)
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)):
            torch.nn.init.normal_(module.weight, std=1.0)
            torch.nn.init.normal_(module.bias, std=1.0)
    return model


def tower(kind: str, **settings: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2_5_omni":
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as modeling

        config = transformers.Qwen2_5OmniAudioEncoderConfig(**QWEN2_5_AUDIO, **settings)
        return sharpen(modeling.Qwen2_5OmniAudioEncoder(config).eval())
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    config = transformers.Qwen3OmniMoeAudioEncoderConfig(**{**QWEN3_AUDIO, **settings})
    return sharpen(modeling.Qwen3OmniMoeAudioEncoder(config).eval())


def clips(frames: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_features`` of clips of ``frames`` each, one after another, and ``feature_lens``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(MEL_BINS, sum(frames), generator=generator), torch.tensor(frames)


def served_equal(graphed: Any, model: torch.nn.Module, frames: list[int], seed: int) -> None:
    features, lens = clips(frames, seed)
    with torch.inference_mode():
        got = graphed(features, feature_lens=lens)
        with graphed.original():
            want = model(features, feature_lens=lens)
    assert type(got) is type(want) and list(got.keys()) == list(want.keys())
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE, frames


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_of_mixed_clips_is_served_from_graphs_equal_to_eager(kind: str) -> None:
    model = tower(kind)
    graphed = layergraph.wrap(
        model, backend=SimulatedGraphs(), observe_calls=0, budget_step=16, max_tokens=512
    )
    assert graphed.adapter.name == "omni_audio"
    rng = random.Random(3)
    stream = [[rng.randint(1, 420) for _ in range(rng.randint(1, 3))] for _ in range(10)]
    for seed, frames in enumerate([[250, 40, 19], *stream]):
        served_equal(graphed, model, frames, seed)
    assert graphed.stats.eager_total == 0 and graphed.stats.replays == 11
    assert graphed.stats.graphs < 11, "budgets are shared by calls of other lengths"


@pytest.mark.parametrize("kind", KINDS)
def test_clips_all_shorter_than_a_chunk_pad_as_the_tower_does(kind: str) -> None:
    """The tower pads chunks to a call's longest; the graphs to a whole chunk, with the
    convolutions' outputs past the call's longest zeroed."""
    model = tower(kind)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0, budget_step=16)
    for seed, frames in enumerate([[3], [5, 6], [13, 2, 9], [19]]):
        served_equal(graphed, model, frames, seed)
    assert graphed.stats.eager_total == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_over_the_largest_budget_is_split_between_clips(kind: str) -> None:
    model = tower(kind)
    graphed = layergraph.wrap(
        model, backend=SimulatedGraphs(), observe_calls=0, budget_step=16, max_tokens=64
    )
    frames = [60, 3, 100, 90, 7] if kind == "qwen2_5_omni" else [400, 30, 300, 90]
    served_equal(graphed, model, frames, seed=1)
    assert graphed.stats.split_calls == 1 and graphed.stats.eager_total == 0
    served_equal(graphed, model, [2000], seed=2)  # one clip over the largest budget
    assert graphed.stats.eager_total == 1


@pytest.mark.parametrize("name", THINKERS)
def test_the_thinkers_audio_and_vision_towers_share_one_wrapper_and_pool(name: str) -> None:
    model = sharpen(thinker(name))
    backend = CountingPools()
    graphed = layergraph.wrap(model, backend=backend, observe_calls=0, budget_step=32)
    assert isinstance(graphed, layergraph.GraphedTowers)
    adapters = {path.rsplit(".", 1)[-1]: t.adapter.name for path, t in graphed.towers.items()}
    assert adapters == {"audio_tower": "omni_audio", "visual": "qwen2_vl"}
    features = torch.randn(2, MEL_BINS, 260)
    mask = torch.tensor([[1] * 260, [1] * 77 + [0] * 183])
    pixels, grid = call([(1, 4, 6), (1, 2, 2)])
    with torch.inference_mode():
        got = model.get_audio_features(features, feature_attention_mask=mask)
        got_image = model.get_image_features(pixels, grid)
        with graphed.original():
            want = model.get_audio_features(features, feature_attention_mask=mask)
            want_image = model.get_image_features(pixels, grid)
    assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
    for mine, theirs in zip(got_image.pooler_output, want_image.pooler_output, strict=True):
        assert relative_error(mine, theirs) <= TOLERANCE  # one per image
    assert backend.pools_made == 1, "the towers' graphs share one pool"
    assert all(stats.replays == 1 and not stats.eager_total for stats in graphed.stats.values())
    assert graphed.unwrap() is model


@pytest.mark.parametrize("name", THINKERS)
def test_the_arguments_a_prefill_passes_on_reach_the_graphs(name: str) -> None:
    """The thinker's forward passes its own keyword arguments on to both towers
    (``generate`` adds ``logits_to_keep`` and ``use_cache``); no tower reads them."""
    model = thinker(name)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0, budget_step=32)
    features, mask = torch.randn(1, MEL_BINS, 150), torch.ones(1, 150, dtype=torch.long)
    pixels, grid = call([(1, 4, 6)])
    passed_on = dict(logits_to_keep=1, use_cache=True, return_dict=True)
    with torch.inference_mode():
        got = model.get_audio_features(features, feature_attention_mask=mask, **passed_on)
        got_image = model.get_image_features(pixels, grid, **passed_on)
        with graphed.original():
            want = model.get_audio_features(features, feature_attention_mask=mask)
            want_image = model.get_image_features(pixels, grid)
    assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
    assert relative_error(got_image.pooler_output[0], want_image.pooler_output[0]) <= TOLERANCE
    eager = {path: dict(stats.eager_calls) for path, stats in graphed.stats.items()}
    assert all(stats.replays == 1 for stats in graphed.stats.values()), eager
    graphed.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_clips_are_refused_by_name_before_any_capture(kind: str) -> None:
    graphed = layergraph.wrap(tower(kind), backend=SimulatedGraphs(), observe_calls=0)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="feature_lens"):
            graphed(torch.randn(MEL_BINS, 50), feature_lens=torch.tensor([20, 20]))
        with pytest.raises(ValueError, match=f"{MEL_BINS} mel bins"):
            graphed(torch.randn(MEL_BINS + 1, 40), feature_lens=torch.tensor([40]))
    assert graphed.stats.graphs == 0 and graphed.stats.replays == 0


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_run_eagerly_and_tuples_are_returned_as_asked(kind: str) -> None:
    model = tower(kind)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0)
    features, lens = clips([150, 30], seed=5)
    with torch.inference_mode():
        states = graphed(features, feature_lens=lens, output_hidden_states=True)
        plain = graphed(features, feature_lens=lens, return_dict=False)
        with graphed.original():
            want = model(features, feature_lens=lens, return_dict=False)
    assert len(states.hidden_states) == AUDIO["encoder_layers"] + 1
    assert isinstance(plain, tuple) and len(plain) == len(want)
    assert relative_error(plain[0], want[0]) <= TOLERANCE
    assert sum(graphed.stats.eager_calls.values()) == 1 and graphed.stats.replays == 1


def test_a_qwen3_tower_whose_chunks_its_own_forward_miscounts_is_refused() -> None:
    """Qwen3-Omni's length function counts 13 tokens for any whole chunk (``n_window`` 50)."""
    with pytest.raises(layergraph.AdapterMismatch, match="counts 13 tokens"):
        layergraph.wrap(tower("qwen3_omni", n_window=10), adapter="omni_audio")
