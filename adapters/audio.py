"""Plugin for transformers' audio encoders of whole clips: Whisper, Qwen2-Audio, wav2vec 2.0,
HuBERT and WavLM.

Each family is one record (:class:`~layergraph_adapters.kit.tower_specs.TowerSpec`). Whisper's
and Qwen2-Audio's encoders (log-mel features of one fixed length) are served by the audio
encoder plan (:mod:`layergraph_adapters.kit.audio_encoder`), the raw-waveform encoders by the
waveform plan (:mod:`layergraph_adapters.kit.waveform`): the encoder alone, or inside the
model that holds it (``WhisperForConditionalGeneration``, ``Qwen2AudioForConditionalGeneration``,
``Wav2Vec2ForCTC``...), with the encoder's forward routed to the graphs and the rest of the
model eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from layergraph import PlanContext, hookimpl
from layergraph_adapters.kit.audio_encoder import AudioEncoderPlan, mel_features
from layergraph_adapters.kit.hf_vision import VisionTowerAdapter, VisionTowerPlan, adapter_class
from layergraph_adapters.kit.tower_specs import TowerSpec
from layergraph_adapters.kit.waveform import WaveformPlan, waveforms

__all__ = [
    "AUDIO_ENCODERS",
    "HUBERT",
    "QWEN2_AUDIO",
    "WAV2VEC2",
    "WAVEFORM_ENCODERS",
    "WAVLM",
    "WHISPER",
    "WaveformAdapter",
]

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


def _waveform_encoder(adapter: str, family: str, prefix: str) -> TowerSpec:
    """The record of a raw-waveform encoder family whose classes start with ``prefix``, held
    as ``adapter`` by its models with a head (``Wav2Vec2ForCTC``...)."""
    return TowerSpec(
        adapter=adapter,
        classes=(f"{prefix}Model",),
        family=family,
        embeddings=(),
        mlp="feed_forward",
        feature_settings=(),
        paths=(adapter,),
        inputs=waveforms,
        plan=WaveformPlan,
    )


WAV2VEC2 = _waveform_encoder("wav2vec2", "wav2vec 2.0", "Wav2Vec2")
HUBERT = _waveform_encoder("hubert", "HuBERT", "Hubert")
WAVLM = _waveform_encoder("wavlm", "WavLM", "WavLM")

AUDIO_ENCODERS: tuple[TowerSpec, ...] = (WHISPER, QWEN2_AUDIO)
"""The families of log-mel encoders this plugin serves."""
WAVEFORM_ENCODERS: tuple[TowerSpec, ...] = (WAV2VEC2, HUBERT, WAVLM)
"""The families of raw-waveform encoders this plugin serves."""


class WaveformAdapter(VisionTowerAdapter):
    """A raw-waveform encoder family's adapter. ``length_step`` (samples; 8000 is half a
    second): calls of models whose answer padding keeps are padded to a multiple of it;
    ``None`` (the default): every length its own graph
    (:mod:`layergraph_adapters.kit.waveform`). The other options are
    :class:`~layergraph_adapters.kit.hf_vision.VisionTowerAdapter`'s."""

    def __init__(self, length_step: int | None = WaveformPlan.length_step, **options: Any) -> None:
        if length_step is not None and length_step < 1:
            raise ValueError(f"length_step must be a positive number of samples, got {length_step}")
        super().__init__(**options)
        self.length_step = length_step

    def make_plan(
        self, tower: nn.Module, feature_layers: int | list[int] | None, context: PlanContext
    ) -> VisionTowerPlan:
        plan = super().make_plan(tower, feature_layers, context)
        plan.length_step = self.length_step
        return plan


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    for spec in AUDIO_ENCODERS:
        register(adapter_class(spec))
    for spec in WAVEFORM_ENCODERS:
        register(adapter_class(spec, WaveformAdapter))
