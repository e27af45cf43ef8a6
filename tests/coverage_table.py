"""Which of transformers' vision towers and VLMs layergraph serves, and why not the others.

The walk: every model class of transformers' auto mappings for image-text-to-text models,
image models and zero-shot image classifiers (dual encoders), as the installed transformers
has them. Each class is either served (a tiny model of it in :mod:`tiny_models`, which
``adapter="auto"`` must recognise and whose answers must equal the unwrapped model's) or
listed in :data:`UNSERVED` with the reason. A class a new transformers release adds is in
neither, and the coverage test names it. The test and ``benchmarks/coverage_page.py`` (the
docs' coverage page) both read this module.
"""

from __future__ import annotations

from typing import Any

import torch
from tiny_models import BLIP_VLMS, DUALS, HEADS, TOWERS, VLMS, Tiny, transformers_kept
from torch import nn

import layergraph

SERVED: dict[str, Tiny] = {**TOWERS, **VLMS, **BLIP_VLMS, **DUALS, **HEADS}
"""Every class layergraph serves at fixed shapes, with its tiny model: towers, VLMs, dual
encoders and models with a head of their own on a served tower."""

PACKED_SERVED: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl",
    "Qwen3VLForConditionalGeneration": "qwen2_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen2_vl",
    "Qwen3_5ForConditionalGeneration": "qwen2_vl",
    "Qwen3_5MoeForConditionalGeneration": "qwen2_vl",
    "Glm4vForConditionalGeneration": "qwen2_vl",
    "Glm4vMoeForConditionalGeneration": "qwen2_vl",
    "Glm46VForConditionalGeneration": "qwen2_vl",
    "GlmOcrForConditionalGeneration": "qwen2_vl",
    "Glm5NextForConditionalGeneration": "qwen2_vl",
    "Lfm2VlForConditionalGeneration": "siglip2",
    "LightOnOcrForConditionalGeneration": "pixtral",
    "Mistral3ForConditionalGeneration": "pixtral",
    "MistralLarge4ForConditionalGeneration": "pixtral",
    "Siglip2Model": "siglip2",
    "Qwen2_5OmniThinkerForConditionalGeneration": "qwen2_vl",
    "Qwen3OmniMoeThinkerForConditionalGeneration": "qwen2_vl",
}
"""Every class layergraph serves in packed mode (images of their own sizes packed into one
sequence per token budget), with its adapter; the coverage test builds each tiny with the
adapter's own test builders and checks its image features against eager."""

TOWERS_IN_PLACE: dict[str, dict[str, str]] = {
    "VideoLlavaForConditionalGeneration": {
        "model.video_tower": "clip",
        "model.image_tower": "clip",
    },
    "DepthProModel": {
        "encoder.patch_encoder.model": "dinov2",
        "encoder.image_encoder.model": "dinov2",
    },
    "PI0ForConditionalGeneration": {"model.vlm": "siglip"},
    "VisionEncoderDecoderModel": {"encoder": "vit"},
    "ColPaliForRetrieval": {"vlm": "siglip"},
    "ColQwen2ForRetrieval": {"vlm": "qwen2_vl"},
}
"""Every walked class no adapter recognises whose towers are served in place, each by its own
plan under one wrapper (:mod:`layergraph.multi_tower`), with its towers' paths and adapters;
the coverage test builds each on the meta device and checks the towers ``wrap`` finds, and
tests/test_multi_tower.py their answers."""

_BLIP_TWO_STACKS = {"vision_model": "blip", "qformer": "qformer"}
SEVERAL_KINDS: dict[str, dict[str, str]] = {
    "Blip2ForConditionalGeneration": _BLIP_TWO_STACKS,
    "Blip2ForImageTextRetrieval": _BLIP_TWO_STACKS,
    "InstructBlipForConditionalGeneration": _BLIP_TWO_STACKS,
    "InstructBlipVideoForConditionalGeneration": _BLIP_TWO_STACKS,
    "DeepseekVLHybridForConditionalGeneration": {
        "high_res_vision_model": "sam",
        "vision_model": "siglip",
    },
    "Qwen2_5OmniThinkerForConditionalGeneration": {
        "audio_tower": "omni_audio",
        "visual": "qwen2_vl",
    },
    "Qwen3OmniMoeThinkerForConditionalGeneration": {
        "audio_tower": "omni_audio",
        "visual": "qwen2_vl",
    },
}
"""Served classes holding towers that different adapters serve, each tower in place by its own
plan under one wrapper: each tower's attribute name with its adapter (the path above it
changes between transformers releases). Their image features are checked with
:data:`SERVED`'s or :data:`PACKED_SERVED`'s (whose adapter names the tower whose stats are
read); tests/test_omni_audio.py checks the thinkers' audio features."""


def served_stats(graphed: Any, adapter: str) -> Any:
    """The stats of ``graphed``, or, for a wrapper of several towers, of the one ``adapter``
    serves."""
    if not isinstance(graphed, layergraph.GraphedTowers):
        return graphed.stats
    [stats] = [tower.stats for tower in graphed.towers.values() if tower.adapter.name == adapter]
    return stats


AUDIO_SERVED: dict[str, str] = {
    "WhisperModel": "whisper",
    "WhisperForConditionalGeneration": "whisper",
    "WhisperForAudioClassification": "whisper",
    "Qwen2AudioForConditionalGeneration": "qwen2_audio",
    "Wav2Vec2Model": "wav2vec2",
    "Wav2Vec2ForCTC": "wav2vec2",
    "Wav2Vec2ForSequenceClassification": "wav2vec2",
    "HubertModel": "hubert",
    "HubertForCTC": "hubert",
    "WavLMModel": "wavlm",
    "WavLMForCTC": "wavlm",
}
"""The audio models layergraph serves, outside the walked mappings, with their adapters
(tests/test_audio_encoders.py, tests/test_waveform_encoders.py and tests/test_omni_audio.py
check their answers, and the encoders alone; the coverage test their recognition)."""

MAPPINGS = (
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_MAPPING_NAMES",
    "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
)
"""The auto mappings of transformers whose classes have a vision tower, or are one."""

PACKED = "variable resolution, images of their own sizes packed into one sequence: packed mode"
NAFLEX = "SigLIP2 NaFlex: variable resolution with spatial shapes and a patch mask: packed mode"
PADDED_PATCHES = "variable-resolution patches padded to a maximum count, with a mask: packed mode"
CONVOLUTIONAL = "a convolutional or hierarchical backbone, not layers over one sequence"
DETECTOR = "a detection or depth model around a backbone"
VIDEO = "a video model: frames and time in one sequence"
VQ_TOKENS = "images become the tokens of a VQ image tokenizer: no vision tower of layers"
NOT_IN_TABLE = "a ViT-style tower not in the table yet (one entry of layergraph_adapters.towers)"
OWN_TOWER = "a vision tower of its own, not in the table yet"

UNSERVED: dict[str, str] = {
    # packed or variable resolution
    **dict.fromkeys(
        (
            "Qwen4ExpForConditionalGeneration",
            "Lfm3VlForConditionalGeneration",
            "Kimi_K25ForConditionalGeneration",
            "PaddleOCRVLForConditionalGeneration",
            "Ernie4_5_VLMoeForConditionalGeneration",
            "HunYuanVLForConditionalGeneration",
            "HYV4VLForConditionalGeneration",
            "HyperCLOVAXVisionV2ForConditionalGeneration",
            "Cosmos3EdgeForConditionalGeneration",
            "CohereCompassForConditionalGeneration",
            "Dots3NoteForConditionalGeneration",
            "Exaone4_5_ForConditionalGeneration",
            "Inkling2ForConditionalGeneration",
            "Inkling2LoopForConditionalGeneration",
            "MiniCPMOcrForConditionalGeneration",
            "MiniCPMV4_6ForConditionalGeneration",
            "MiniCPMV4_7ForConditionalGeneration",
            "MiniMaxM3SparseForConditionalGeneration",
            "MuseGlimmerForConditionalGeneration",
            "MuseSparkForConditionalGeneration",
            "VideoLlama3ForConditionalGeneration",
            "Gemma4ForConditionalGeneration",
            "Gemma4UnifiedForConditionalGeneration",
            "DiffusionGemmaForBlockDiffusion",
            "NemotronH_Omni_Reasoning_V3",
        ),
        PACKED,
    ),
    "Cosmos3OmniForConditionalGeneration": (
        "holds a Qwen3-VL tower but calls it its own way, which the qwen2_vl adapter is not "
        "checked against: the adapter recognises the Qwen VLMs themselves only (the tower alone, "
        "wrapped on its own, is served)"
    ),
    "Pix2StructForConditionalGeneration": PADDED_PATCHES,
    "Kosmos2_5ForConditionalGeneration": PADDED_PATCHES,
    "Mistral4ForCausalLM": "a language model alone: no vision tower",
    # not a stack of layers over one sequence of patches
    **dict.fromkeys(
        (
            "BitModel",
            "ConvNextModel",
            "ConvNextV2Model",
            "DINOv3ConvNextModel",
            "DinatModel",
            "EfficientNetModel",
            "FocalNetModel",
            "GLPNModel",
            "HieraModel",
            "LevitModel",
            "MobileNetV1Model",
            "MobileNetV2Model",
            "MobileViTModel",
            "MobileViTV2Model",
            "PoolFormerModel",
            "PvtModel",
            "RegNetModel",
            "ResNetModel",
            "SegformerModel",
            "SwiftFormerModel",
            "Swin2SRModel",
            "SwinModel",
            "Swinv2Model",
            "AlignModel",
            "Florence2ForConditionalGeneration",
            "FastVlmForConditionalGeneration",
            "Gemma3nForConditionalGeneration",
        ),
        CONVOLUTIONAL,
    ),
    **dict.fromkeys(
        (
            "ConditionalDetrModel",
            "DabDetrModel",
            "DeformableDetrModel",
            "DetrModel",
            "TableTransformerModel",
            "DPTModel",
            "YolosModel",
        ),
        DETECTOR,
    ),
    **dict.fromkeys(
        (
            "VideoPrismVisionModel",
            "VideoPrismClipModel",
        ),
        VIDEO,
    ),
    **dict.fromkeys(
        (
            "ChameleonForConditionalGeneration",
            "Emu3ForConditionalGeneration",
            "Apertus1p5ForConditionalGeneration",
        ),
        VQ_TOKENS,
    ),
    "FuyuForCausalLM": "no vision tower: image patches go straight into the language model",
    "ImageGPTModel": "no vision tower: the pixels are a GPT's tokens",
    "UdopForConditionalGeneration": "no vision tower: patches join the text in a T5 encoder",
    "EvollaForProteinText2Text": "a protein-text model: no vision tower",
    "ViTMAEModel": "masks random patches on every call: a graph would replay one mask",
    "TimmBackbone": "a timm model behind transformers' backbone API: the timm adapter serves timm",
    "TimmWrapperModel": "a timm model inside transformers' wrapper: the timm adapter serves timm",
    "PerceptionLMForConditionalGeneration": "a timm tower inside transformers' TimmWrapperModel",
    # towers the table does not describe yet
    **dict.fromkeys(
        (
            "VitDetModel",
            "GitForCausalLM",
            "IdeficsForVisionText2Text",
            "Kosmos2ForConditionalGeneration",
        ),
        NOT_IN_TABLE,
    ),
    **dict.fromkeys(
        (
            "DeepseekOcr2ForConditionalGeneration",
            "GotOcr2ForConditionalGeneration",
            "GraniteDoclingForConditionalGeneration",
            "InklingForConditionalGeneration",
            "Molmo2ForConditionalGeneration",
            "Ovis2ForConditionalGeneration",
            "PPFormulaNetForConditionalGeneration",
            "QianfanOCRForConditionalGeneration",
            "Step3p7ForConditionalGeneration",
            "UnlimitedOcrForConditionalGeneration",
        ),
        OWN_TOWER,
    ),
    "Granite4VisionForConditionalGeneration": (
        "reads several CLIP hidden states through window Q-Formers, chosen by settings of its "
        "own rather than vision_feature_layer: not checked yet"
    ),
}
"""Every walked class layergraph does not serve, with the reason."""


NOTES: dict[str, str] = {
    "DeepseekVLHybridForConditionalGeneration": "its SAM high-resolution tower runs eagerly",
    "Llama4ForConditionalGeneration": (
        "its forward and generate() fail in transformers 5.24 itself (a field the text "
        "model's output lacks); get_image_features() is graphed"
    ),
}
"""What the coverage page adds about a served class."""


def walked_classes() -> dict[str, str]:
    """Every class the walk finds in the installed transformers, with its model type."""
    from transformers.models.auto import modeling_auto

    found: dict[str, str] = {}
    with transformers_kept() as transformers:
        for mapping in MAPPINGS:
            for model_type, class_name in getattr(modeling_auto, mapping, {}).items():
                if hasattr(transformers, class_name):
                    found.setdefault(class_name, model_type)
    return found


def meta_model(class_name: str) -> nn.Module | Exception | None:
    """``class_name`` built from its own default configuration on the meta device (no
    memory, no weights), the error building it raised, or ``None`` where the installed
    transformers has no such class."""
    with transformers_kept() as transformers:
        model_class = getattr(transformers, class_name, None)
        if model_class is None:
            return None
        try:
            with torch.device("meta"):
                return model_class(model_class.config_class())
        except Exception as error:  # a default configuration some classes cannot build from
            return error


PACKED_FAMILIES = {
    "pixtral": "Pixtral (Mistral 3, LightOnOCR)",
    "qwen2_vl": "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, the Omni thinkers and GLM-4.1V and later",
    "siglip2": "SigLIP2 NaFlex (LFM2-VL)",
}
"""The families the packed adapters serve, which have no tower table entry."""


def family_of(adapter: str) -> str:
    """The family an adapter serves, as its table entry (or :data:`PACKED_FAMILIES`) names
    it."""
    from layergraph.plugins import get_registry

    spec: Any = getattr(get_registry().factory(adapter), "spec", None)
    return spec.family if spec is not None else PACKED_FAMILIES.get(adapter, adapter)
