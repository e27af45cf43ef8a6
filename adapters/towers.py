"""The table of transformers vision-tower families, and the plugin that serves each of them.

Each :class:`~layergraph_adapters.kit.tower_specs.TowerSpec` below is one family; the plugin
registers one adapter per entry (``adapter="siglip"``, ``adapter="idefics"``...), all served by
:mod:`layergraph_adapters.kit.hf_vision`'s plan, or by a family's own plan where the spec names one.
A new family whose tower is a patch embedding, a list of layers and what follows them is a few
lines here; its quirks, if any, go in a module of its own. InternViT, whose adapter takes an
attention backend, is registered by :mod:`layergraph_adapters.internvl`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layergraph import hookimpl
from layergraph_adapters.kit.beit import BeitPlan
from layergraph_adapters.kit.device_tensors import SamPlan
from layergraph_adapters.kit.fused_norm import ENCODER_LAYER
from layergraph_adapters.kit.fused_qkv import fused_attention_forward
from layergraph_adapters.kit.hf_vision import adapter_class
from layergraph_adapters.kit.idefics import IdeficsPlan
from layergraph_adapters.kit.mllama import MllamaVisionPlan, tiles_of_images
from layergraph_adapters.kit.qformer import QFormerPlan, queries_and_image_tokens
from layergraph_adapters.kit.tower_specs import TOWER_PATHS, TowerSpec, images
from layergraph_adapters.kit.video_tower import VideoTowerPlan, video_clips

__all__ = [
    "AIMV2",
    "BEIT",
    "BLIP",
    "CLIP",
    "DEIT",
    "DINOV2",
    "DINOV3",
    "IDEFICS",
    "IJEPA",
    "JANUS",
    "LLAMA4",
    "MLCD",
    "MLLAMA",
    "PIXIO",
    "QFORMER",
    "SAM",
    "SIGLIP",
    "TIPS",
    "TOWERS",
    "VIDEO",
    "VIT",
    "VIT_MSN",
]

SIGLIP = TowerSpec(
    adapter="siglip",
    classes=("SiglipVisionModel", "SiglipVisionTransformer"),
    casts_pixels=True,
    family="SigLIP",
    fused_attention=fused_attention_forward,
    layer_form=ENCODER_LAYER,
)
"""SigLIP (SigLIP2 checkpoints of fixed resolution load as this class too): no class token,
the attention-pooling head captured with the layers. Inside PaliGemma, LLaVA-OneVision,
Gemma 3, Aya Vision, Cohere2Vision and DeepSeek-VL."""

CLIP = TowerSpec(
    adapter="clip",
    classes=(
        "CLIPVisionModel",
        "CLIPVisionModelWithProjection",
        "CLIPVisionTransformer",
        "MetaClip2VisionModel",
        "MetaClip2VisionModelWithProjection",
        "AltCLIPVisionModel",
        "ChineseCLIPVisionModel",
        "CLIPSegVisionModel",
    ),
    casts_pixels=True,
    family="CLIP (MetaCLIP 2, AltCLIP, Chinese-CLIP, CLIPSeg)",
    paths=(*TOWER_PATHS, "clip.vision_model"),
    prefix_tokens=1,
    fused_attention=fused_attention_forward,
    layer_form=ENCODER_LAYER,
)
"""CLIP: the class token; the projection of ``CLIPVisionModelWithProjection`` included. Inside
LLaVA and LLaVA-NeXT, which read layer -2. MetaCLIP 2's, AltCLIP's, Chinese-CLIP's and
CLIPSeg's towers are CLIP's (transformers copies its code), inside their dual encoders."""


def images_with_patch_mask(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Images and the ``patch_attention_mask`` an Idefics VLM passes with them (all true for
    images without padding)."""
    grid = (size[0] // config.patch_size, size[1] // config.patch_size)
    mask = torch.ones(batch, *grid, dtype=torch.bool, device=device)
    return {**images(config, batch, size, dtype, device), "patch_attention_mask": mask}


IDEFICS = TowerSpec(
    adapter="idefics",
    classes=(
        "Idefics2VisionTransformer",
        "Idefics3VisionTransformer",
        "SmolVLMVisionTransformer",
    ),
    family="Idefics2, Idefics3 and SmolVLM",
    image_sizes="any",  # position ids follow each image's patch grid
    fused_attention=fused_attention_forward,
    inputs=images_with_patch_mask,
    plan=IdeficsPlan,
)
"""The SigLIP-derived towers of Idefics2, Idefics3 and SmolVLM: no class token, images of any
size. The VLMs pass a ``patch_attention_mask``, a batched input of the graphs like the pixels,
so images with padding are attended as eager attends them."""

JANUS = TowerSpec(
    adapter="janus",
    classes=("JanusVisionModel",),
    casts_pixels=True,
    family="Janus",
)
"""Janus's SigLIP-L tower (its q and k norms leave ``fuse_qkv`` out); inside ``JanusModel``
and ``JanusForConditionalGeneration``."""

AIMV2 = TowerSpec(
    adapter="aimv2",
    classes=("Aimv2VisionModel",),
    family="AIMv2",
    attention="attention",
    mlp="ffn",
    image_sizes=lambda config: "any" if config.is_native else "fixed",
    fused_attention=fused_attention_forward,
)
"""AIMv2: no class token, a SwiGLU MLP, the attention-pooling head captured with the layers;
the native-resolution checkpoints (sinusoidal positions) take any image size."""

DINOV2 = TowerSpec(
    adapter="dinov2",
    classes=("Dinov2Model", "Dinov2WithRegistersModel"),
    casts_pixels=True,
    paths=("dinov2", *TOWER_PATHS),
    family="DINOv2",
    layers=("encoder.layer",),
    attention="attention",
    prefix_tokens=lambda config: 1 + getattr(config, "num_register_tokens", 0),
    image_sizes="any",  # the position embedding is interpolated to every image
)
"""DINOv2, with and without register tokens: the class token and the registers."""

VIT = TowerSpec(
    adapter="vit",
    classes=("ViTModel",),
    casts_pixels=True,
    paths=("vit", *TOWER_PATHS),
    family="ViT",
    layers=("layers", "encoder.layer"),  # transformers 5.17 moved the layers to the model
    attention="attention",
    prefix_tokens=1,
)
"""transformers' ViT: the class token, the pooler captured with the layers."""

LLAMA4 = TowerSpec(
    adapter="llama4",
    classes=("Llama4VisionModel",),
    family="Llama 4",
    layers=("model.layers",),
    embeddings=(),
    prefix_tokens=1,
    image_sizes="fixed",  # rotary positions of the configuration's patch grid
)
"""Llama 4's vision model: a class token, 2-d rotary attention (which leaves ``fuse_qkv``
out), and the pixel-shuffle adapter captured with the layers."""

MLLAMA = TowerSpec(
    adapter="mllama",
    classes=("MllamaVisionModel",),
    casts_pixels=True,
    family="Llama 3.2 Vision (Mllama)",
    layers=("transformer.layers",),
    embeddings=(),
    prefix_tokens=1,
    image_sizes="fixed",
    inputs=tiles_of_images,
    plan=MllamaVisionPlan,
)
"""Llama 3.2 Vision's tower: tiles of images as a 6-d input with aspect-ratio ids and masks,
a local and a global encoder (:mod:`layergraph_adapters.kit.mllama`)."""

_VIT_LAYERS = ("layers", "encoder.layer")
"""Where transformers' ViT copies keep their layers (5.17 moved them to the model)."""

DEIT = TowerSpec(
    adapter="deit",
    classes=("DeiTModel",),
    casts_pixels=True,
    family="DeiT",
    layers=_VIT_LAYERS,
    attention="attention",
    prefix_tokens=2,  # the class and distillation tokens
    paths=("deit", *TOWER_PATHS),
)
"""DeiT: ViT with a distillation token; inside ``DeiTForImageClassification``."""

BEIT = TowerSpec(
    adapter="beit",
    classes=("BeitModel", "Data2VecVisionModel"),
    family="BEiT and Data2Vec-Vision",
    layers=_VIT_LAYERS,
    attention="attention",
    prefix_tokens=1,
    paths=("beit", "data2vec_vision", *TOWER_PATHS),
    plan=BeitPlan,
)
"""BEiT and Data2Vec-Vision: the class token, relative position biases (their indices kept on
the device, :mod:`layergraph_adapters.kit.beit`), layer scales."""

IJEPA = TowerSpec(
    adapter="ijepa",
    classes=("IJepaModel",),
    casts_pixels=True,
    family="I-JEPA",
    layers=_VIT_LAYERS,
    attention="attention",
    paths=("ijepa", *TOWER_PATHS),
)
"""I-JEPA: a ViT without a class token."""

VIT_MSN = TowerSpec(
    adapter="vit_msn",
    classes=("ViTMSNModel",),
    casts_pixels=True,
    family="ViT-MSN",
    layers=_VIT_LAYERS,
    attention="attention",
    prefix_tokens=1,
    paths=("vit", *TOWER_PATHS),
)
"""ViT-MSN: transformers' ViT trained by masked siamese networks."""


def _class_and_registers(config: Any) -> int:
    return 1 + config.num_register_tokens


DINOV3 = TowerSpec(
    adapter="dinov3",
    classes=("DINOv3ViTModel",),
    casts_pixels=True,
    family="DINOv3",
    layers=("model.layer",),
    attention="attention",
    prefix_tokens=_class_and_registers,
    image_sizes="any",  # rotary positions of each image's patch grid
)
"""DINOv3's ViT: the class token and registers, 2-d rotary attention, layer scales."""

TIPS = TowerSpec(
    adapter="tipsv2",
    classes=("Tipsv2VisionModel",),
    casts_pixels=True,
    family="TIPSv2",
    layers=("encoder.layer",),
    attention="attention",
    prefix_tokens=_class_and_registers,
    image_sizes="any",
)
"""TIPSv2's vision tower: DINOv2-style layers, the class token and registers; inside
``Tipsv2Model``."""

PIXIO = TowerSpec(
    adapter="pixio",
    classes=("PixioModel",),
    casts_pixels=True,
    family="Pixio",
    layers=_VIT_LAYERS,
    attention="attention",
    prefix_tokens=lambda config: config.n_cls_tokens,
    image_sizes="any",
)
"""Pixio: a ViT with several class tokens."""

MLCD = TowerSpec(
    adapter="mlcd",
    classes=("MLCDVisionModel",),
    casts_pixels=True,
    family="MLCD",
    prefix_tokens=1,
    image_sizes="any",  # 2-d rotary positions of each image's patch grid
)
"""MLCD: CLIP's layers with 2-d rotary attention (which leaves ``fuse_qkv`` out)."""

BLIP = TowerSpec(
    adapter="blip",
    classes=(
        "BlipVisionModel",
        "Blip2VisionModel",
        "InstructBlipVisionModel",
        "InstructBlipVideoVisionModel",
    ),
    casts_pixels=True,
    family="BLIP, BLIP-2 and InstructBLIP",
    prefix_tokens=1,
)
"""The ViTs of BLIP, BLIP-2, InstructBLIP and InstructBLIP-Video (their q, k and v one
product already), inside their models as ``vision_model``."""

QFORMER = TowerSpec(
    adapter="qformer",
    classes=("Blip2QFormerModel", "InstructBlipQFormerModel", "InstructBlipVideoQFormerModel"),
    family="the Q-Former of BLIP-2 and InstructBLIP",
    layers=("encoder.layer",),
    embeddings=(),
    attention="attention",
    mlp="intermediate_query",
    feature_settings=(),
    paths=("qformer",),
    inputs=queries_and_image_tokens,
    plan=QFormerPlan,
)
"""BLIP-2's, InstructBLIP's and InstructBLIP-Video's Q-Former, inside their models as
``qformer``: the second stack, beside the ``blip`` tower
(:mod:`layergraph_adapters.kit.qformer`)."""

SAM = TowerSpec(
    adapter="sam",
    classes=("SamVisionModel", "SamVisionEncoder", "SamHQVisionModel", "SamHQVisionEncoder"),
    casts_pixels=True,
    family="SAM and SAM-HQ",
    layers=("vision_encoder.layers", "layers"),
    embeddings=("vision_encoder.patch_embed", "patch_embed"),
    attention="attn",
    image_sizes="fixed",  # the relative positions of windowed and global attention
    paths=("vision_encoder", "model.vision_encoder", *TOWER_PATHS),
    plan=SamPlan,
)
"""SAM's and SAM-HQ's image encoders: windowed attention with global layers between, relative
positions (gathered on the device while wrapped, :mod:`layergraph_adapters.kit.device_tensors`),
a convolutional neck; inside their models as ``vision_encoder``."""

VIDEO = TowerSpec(
    adapter="video",
    classes=("VideoMAEModel", "VivitModel", "TimesformerModel"),
    casts_pixels=True,
    family="VideoMAE, ViViT and TimeSformer",
    layers=("layers", "encoder.layer"),
    attention="attention",
    prefix_tokens=lambda config: 0 if config.model_type == "videomae" else 1,
    paths=("videomae", "vivit", "timesformer", *TOWER_PATHS),
    inputs=video_clips,
    plan=VideoTowerPlan,
)
"""Video towers of fixed clips: VideoMAE's tubelets (no class token), ViViT's tubelets and
TimeSformer's divided space-time attention (a class token each); inside their video
classifiers."""

TOWERS: tuple[TowerSpec, ...] = (
    SIGLIP,
    CLIP,
    IDEFICS,
    JANUS,
    AIMV2,
    DINOV2,
    VIT,
    LLAMA4,
    MLLAMA,
    DEIT,
    BEIT,
    IJEPA,
    VIT_MSN,
    DINOV3,
    TIPS,
    PIXIO,
    MLCD,
    BLIP,
    QFORMER,
    VIDEO,
    SAM,
)
"""Every family this plugin serves, in the order ``adapter="auto"`` asks them."""


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    for spec in TOWERS:
        register(adapter_class(spec))
