"""Plugin for transformers' audio encoders of fixed-length features: Whisper and Qwen2-Audio.

Each family is one record (:class:`~layergraph_adapters.kit.tower_specs.TowerSpec`) served by
the audio encoder plan (:mod:`layergraph_adapters.kit.audio_encoder`): the encoder alone, or
inside the model that holds it (``WhisperModel``, ``WhisperForConditionalGeneration``,
``WhisperForAudioClassification``, ``Qwen2AudioForConditionalGeneration``), with the encoder's
forward routed to the graphs and the rest of the model eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layergraph import hookimpl
from layergraph_adapters.kit.audio_encoder import AudioEncoderPlan, mel_features
from layergraph_adapters.kit.hf_vision import adapter_class
from layergraph_adapters.kit.tower_specs import TowerSpec

__all__ = ["AUDIO_ENCODERS", "QWEN2_AUDIO", "WHISPER"]

WHISPER = TowerSpec(
    adapter="whisper",
    classes=("WhisperEncoder",),
    family="Whisper",
    layers=("layers",),
    embeddings=(),
    feature_settings=(),
    paths=("encoder", "model.encoder"),
    inputs=mel_features,
    plan=AudioEncoderPlan,
)
"""Whisper's encoder (and distil-whisper's): held as ``encoder`` by ``WhisperModel`` and
``WhisperForAudioClassification``, as ``model.encoder`` by ``WhisperForConditionalGeneration``."""

QWEN2_AUDIO = TowerSpec(
    adapter="qwen2_audio",
    classes=("Qwen2AudioEncoder",),
    family="Qwen2-Audio",
    layers=("layers",),
    embeddings=(),
    feature_settings=(),
    casts_pixels=True,
    paths=("audio_tower", "model.audio_tower"),
    inputs=mel_features,
    plan=AudioEncoderPlan,
)
"""Qwen2-Audio's encoder: Whisper's layout with the tokens pooled by two before the last
norm, held as ``audio_tower`` by ``Qwen2AudioForConditionalGeneration``."""

AUDIO_ENCODERS: tuple[TowerSpec, ...] = (WHISPER, QWEN2_AUDIO)
"""Every family this plugin serves."""


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    for spec in AUDIO_ENCODERS:
        register(adapter_class(spec))
