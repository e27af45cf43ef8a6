"""Tiny transformers towers and VLMs of every family layergraph serves, and how to call them.

Every model is built from a small configuration with random weights (nothing is downloaded):
32x32 images cut into 8-pixel patches, towers of two layers of width 64, and for VLMs a
one-layer text model with a 300-token vocabulary whose last token is the image token. A model
whose class the installed transformers lacks is skipped by name. The family tests and the
coverage test share these.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

IMAGE = 32
PATCH = 8
GRID = IMAGE // PATCH
VOCAB = 300
IMAGE_TOKEN = VOCAB - 1
WIDTH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
LAYERS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
)


@contextlib.contextmanager
def transformers_kept() -> Iterator[Any]:
    """transformers' module object, kept in ``sys.modules`` while its models are imported.

    Importing some of them (Apertus 1.5's, in transformers 5.24) puts a new module object
    there; code holding the first one, a test that patches its ``__version__`` say, would then
    patch what no importer sees.
    """
    import transformers

    try:
        yield transformers
    finally:
        sys.modules["transformers"] = transformers


def transformers_attr(name: str) -> Any:
    """``transformers.<name>``, or for ``"module.Class"`` a class of
    ``transformers.models.<module>.modeling_<module>``; skips the test where the installed
    transformers has no such thing."""
    with transformers_kept() as transformers:
        if "." not in name:
            found = getattr(transformers, name, None)
        else:
            module, _, attr = name.rpartition(".")
            try:
                path = f"transformers.models.{module}.modeling_{module}"
                modeling = importlib.import_module(path)
            except ImportError:
                modeling = None
            found = getattr(modeling, attr, None)
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return found


def seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with torch's generator seeded, in eval mode: equal calls, equal weights."""
    torch.manual_seed(0)
    return build().eval()


def images(batch: int, *leading: int) -> torch.Tensor:
    """``batch`` random images (each ``leading`` deep: tiles, images per prompt)."""
    return torch.randn(batch, *leading, 3, IMAGE, IMAGE)


def main_tensor(output: Any) -> torch.Tensor:
    """What a caller reads: a tensor as it is, lists of per-image features joined, and of a
    model output its pooled features or else its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (list, tuple)):
        return torch.cat([main_tensor(part).flatten(0, -2) for part in output])
    pooled = getattr(output, "pooler_output", None)
    if pooled is not None:
        return main_tensor(pooled)
    return next(value for value in output.values() if isinstance(value, torch.Tensor))


@dataclass(frozen=True)
class Tiny:
    """A tiny model of one transformers class, the adapter that must serve it, and a call."""

    model: str
    """The model's class: exported by transformers, or ``"module.Class"`` (see
    :func:`transformers_attr`)."""
    config: Callable[[], Any]
    """Its tiny configuration."""
    adapter: str
    """The adapter ``adapter="auto"`` must choose."""
    call: Callable[[nn.Module, int], torch.Tensor]
    """What a caller of the model reads for ``batch`` random images (or prompts, for a VLM
    without ``get_image_features``), through the model given: unwrapped or wrapped."""
    prompt: Callable[[int], dict[str, Any]] | None = None
    """A VLM's ``generate`` inputs for ``batch`` random images: token ids holding their image
    tokens, and the pixels; ``None`` for a tower."""

    def build(self) -> nn.Module:
        """The model, random weights from seed 0, eval mode; skips the test where the installed
        transformers lacks its class."""
        model_class, config = transformers_attr(self.model), self.config()
        return seeded(lambda: model_class(config))

    def available(self) -> bool:
        """Whether the installed transformers has the model's class."""
        try:
            transformers_attr(self.model)
        except pytest.skip.Exception:
            return False
        return True

    def answer(self, model: nn.Module, batch: int, seed: int) -> torch.Tensor:
        """:attr:`call` on inputs drawn from ``seed``: equal seeds, equal inputs."""
        torch.manual_seed(seed)
        return self.call(model, batch)


def by_name(*tinies: Tiny) -> dict[str, Tiny]:
    """``tinies`` by the name of their model's class."""
    return {tiny.model.rpartition(".")[2]: tiny for tiny in tinies}


# ---- towers ----------------------------------------------------------------------------------


def tower_config(config_name: str, **settings: Any) -> Callable[[], Any]:
    """A tiny tower configuration of class ``config_name``, for 32x32 images."""
    return lambda: transformers_attr(config_name)(image_size=IMAGE, patch_size=PATCH, **settings)


def tower_call(**extra: Callable[[int], torch.Tensor]) -> Callable[[nn.Module, int], Any]:
    """Calls a tower on ``batch`` images and the ``extra`` inputs made for that batch."""

    def call(model: nn.Module, batch: int) -> torch.Tensor:
        made = {name: make(batch) for name, make in extra.items()}
        return model(pixel_values=images(batch), **made).last_hidden_state

    return call


def clips_call(model: nn.Module, batch: int) -> torch.Tensor:
    """A video tower on ``batch`` random clips of four frames."""
    return model(pixel_values=images(batch, 4)).last_hidden_state


def patch_mask(batch: int) -> torch.Tensor:
    """A ``patch_attention_mask`` whose first image is padded: its last row and column of
    patches are masked, as an Idefics VLM masks an image smaller than the largest in a batch."""
    mask = torch.ones(batch, GRID, GRID, dtype=torch.bool)
    mask[0, -1, :] = False
    mask[0, :, -1] = False
    return mask


def llama4_vision_config() -> Any:
    # The pixel-shuffle MLP takes hidden_size / ratio**2 inputs: intermediate_size is that.
    return transformers_attr("Llama4VisionConfig")(
        **{**WIDTH, "intermediate_size": 256},
        image_size=IMAGE,
        patch_size=PATCH,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
    )


def mllama_vision_config() -> Any:
    return transformers_attr("MllamaVisionConfig")(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=4,
        image_size=IMAGE,
        patch_size=PATCH,
        max_num_tiles=2,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        intermediate_layers_indices=[0, 1],
        vision_output_dim=64 * 3,
    )


def mllama_tiles(batch: int) -> dict[str, torch.Tensor]:
    """One image per prompt in two tiles: the first prompt's image fills both (aspect ratio
    1x2, id 2), the others fill one and leave the other empty, masked (1x1, id 1)."""
    mask = torch.ones(batch, 1, 2, dtype=torch.long)
    mask[1:, :, 1] = 0
    return {
        "pixel_values": images(batch, 1, 2),
        "aspect_ratio_ids": torch.where(mask.sum(-1) == 2, 2, 1),
        "aspect_ratio_mask": mask,
    }


TOWERS: dict[str, Tiny] = by_name(
    Tiny("SiglipVisionModel", tower_config("SiglipVisionConfig", **WIDTH), "siglip", tower_call()),
    Tiny("CLIPVisionModel", tower_config("CLIPVisionConfig", **WIDTH), "clip", tower_call()),
    Tiny(
        "CLIPVisionModelWithProjection",
        tower_config("CLIPVisionConfig", projection_dim=32, **WIDTH),
        "clip",
        lambda model, batch: model(pixel_values=images(batch)).image_embeds,
    ),
    Tiny(
        "InternVLVisionModel",
        lambda: transformers_attr("InternVLVisionConfig")(
            **WIDTH, image_size=[IMAGE, IMAGE], patch_size=[PATCH, PATCH]
        ),
        "internvl",
        tower_call(),
    ),
    Tiny(
        "idefics2.Idefics2VisionTransformer",
        tower_config("Idefics2VisionConfig", **WIDTH),
        "idefics",
        tower_call(patch_attention_mask=patch_mask),
    ),
    Tiny(
        "Idefics3VisionTransformer",
        tower_config("Idefics3VisionConfig", **WIDTH),
        "idefics",
        tower_call(patch_attention_mask=patch_mask),
    ),
    Tiny(
        "SmolVLMVisionTransformer",
        tower_config("SmolVLMVisionConfig", **WIDTH),
        "idefics",
        tower_call(patch_attention_mask=patch_mask),
    ),
    Tiny("JanusVisionModel", tower_config("JanusVisionConfig", **LAYERS), "janus", tower_call()),
    Tiny("Aimv2VisionModel", tower_config("Aimv2VisionConfig", **WIDTH), "aimv2", tower_call()),
    Tiny("Dinov2Model", tower_config("Dinov2Config", **LAYERS), "dinov2", tower_call()),
    Tiny(
        "Dinov2WithRegistersModel",
        tower_config("Dinov2WithRegistersConfig", **LAYERS),
        "dinov2",
        tower_call(),
    ),
    Tiny("ViTModel", tower_config("ViTConfig", **WIDTH), "vit", tower_call()),
    Tiny(
        "Llama4VisionModel",
        llama4_vision_config,
        "llama4",
        tower_call(),
    ),
    Tiny(
        "MllamaVisionModel",
        mllama_vision_config,
        "mllama",
        lambda model, batch: model(**mllama_tiles(batch)).last_hidden_state,
    ),
    Tiny("DeiTModel", tower_config("DeiTConfig", **WIDTH), "deit", tower_call()),
    Tiny(
        "BeitModel",
        tower_config("BeitConfig", use_relative_position_bias=True, **WIDTH),
        "beit",
        tower_call(),
    ),
    Tiny(
        "Data2VecVisionModel",
        tower_config("Data2VecVisionConfig", use_relative_position_bias=True, **WIDTH),
        "beit",
        tower_call(),
    ),
    Tiny("IJepaModel", tower_config("IJepaConfig", **WIDTH), "ijepa", tower_call()),
    Tiny("ViTMSNModel", tower_config("ViTMSNConfig", **WIDTH), "vit_msn", tower_call()),
    Tiny(
        "DINOv3ViTModel",
        tower_config("DINOv3ViTConfig", num_register_tokens=2, **WIDTH),
        "dinov3",
        tower_call(),
    ),
    Tiny(
        "Tipsv2VisionModel",
        tower_config("Tipsv2VisionConfig", num_register_tokens=1, **WIDTH),
        "tipsv2",
        tower_call(),
    ),
    Tiny("PixioModel", tower_config("PixioConfig", n_cls_tokens=2, **WIDTH), "pixio", tower_call()),
    Tiny("MLCDVisionModel", tower_config("MLCDVisionConfig", **WIDTH), "mlcd", tower_call()),
    Tiny(
        "SamVisionModel",
        tower_config(
            "SamVisionConfig",
            hidden_size=32,
            output_channels=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            window_size=2,
            global_attn_indexes=[1],
            mlp_dim=64,
        ),
        "sam",
        tower_call(),
    ),
    Tiny(
        "VideoMAEModel",
        tower_config("VideoMAEConfig", num_frames=4, **WIDTH),
        "video",
        clips_call,
    ),
    Tiny(
        "TimesformerModel",
        tower_config("TimesformerConfig", num_frames=4, **WIDTH),
        "video",
        clips_call,
    ),
    Tiny(
        "VivitModel",
        lambda: transformers_attr("VivitConfig")(
            image_size=IMAGE, num_frames=4, tubelet_size=[2, PATCH, PATCH], **WIDTH
        ),
        "video",
        clips_call,
    ),
)
"""A tiny tower of every family, by class name."""


# ---- VLMs ------------------------------------------------------------------------------------


def vision(config_name: str, **settings: Any) -> Callable[[], dict[str, Any]]:
    """A tiny vision configuration as a dict, as VLM configurations take it, made when the VLM's
    configuration is (so that a class the installed transformers lacks skips that test only)."""
    settings = {**WIDTH, "image_size": IMAGE, "patch_size": PATCH, **settings}
    return lambda: transformers_attr(config_name)(**settings).to_dict()


def text(model_type: str, **settings: Any) -> dict[str, Any]:
    """A tiny text configuration of ``model_type``, as VLM configurations take it."""
    return {"model_type": model_type, **TEXT, **settings}


def vlm_config(config_name: str, **settings: Any) -> Callable[[], Any]:
    """A tiny VLM configuration of class ``config_name`` made of ``settings`` (a callable
    setting is called when the configuration is made)."""

    def make() -> Any:
        made = {key: value() if callable(value) else value for key, value in settings.items()}
        return transformers_attr(config_name)(**made)

    return make


def tokens(count: int) -> dict[str, torch.Tensor]:
    """A one-prompt ``input_ids`` holding ``count`` image tokens between ordinary ones."""
    return {"input_ids": torch.tensor([[1, 2, *[IMAGE_TOKEN] * count, 3]])}


def features(
    inputs: Callable[[int], dict[str, Any]], holder: str = ""
) -> Callable[[nn.Module, int], torch.Tensor]:
    """Calls a VLM's ``get_image_features`` (of its submodule ``holder``, for a VLM whose
    outer class has none) on ``inputs(batch)``."""

    def call(model: nn.Module, batch: int) -> torch.Tensor:
        owner = getattr(model, holder) if holder else model
        return main_tensor(owner.get_image_features(**inputs(batch)))

    return call


def pixels(batch: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": images(batch)}


def llama4_pixels(batch: int) -> dict[str, Any]:
    """Pixels, and the feature strategy Llama 4's ``get_image_features`` required before
    transformers 5.24 (and passes on to the tower, which ignores it, since)."""
    return {**pixels(batch), "vision_feature_select_strategy": "default"}


def image_sets(batch: int) -> dict[str, torch.Tensor]:
    """``batch`` images as Idefics VLMs take them: one prompt, ``[1, images, 3, H, W]``."""
    return {"pixel_values": images(batch).unsqueeze(0)}


def llava_next_inputs(batch: int) -> dict[str, torch.Tensor]:
    """``batch`` images as LLaVA-NeXT takes them: each a base view and one grid tile."""
    return {
        "pixel_values": images(batch, 2),
        "image_sizes": torch.tensor([[IMAGE, IMAGE]] * batch),
    }


def mllama_prompts(batch: int) -> dict[str, torch.Tensor]:
    """``batch`` prompts, each an image token and three text tokens, with their tiles
    (:func:`mllama_tiles`) and the mask saying which tiles each text token attends to."""
    tiles = mllama_tiles(batch)
    ids = torch.arange(batch * 3).reshape(batch, 3) % 200 + 4
    cross = tiles["aspect_ratio_mask"][:, None].expand(batch, 4, 1, 2)
    return {
        "input_ids": torch.cat([torch.full((batch, 1), IMAGE_TOKEN), ids], dim=1),
        "cross_attention_mask": cross.contiguous(),
        **tiles,
    }


def prompt(count: Callable[[int], int], inputs: Callable[[int], dict[str, Any]]) -> Any:
    """``generate`` inputs: ``count(batch)`` image tokens and ``inputs(batch)``."""
    return lambda batch: {**tokens(count(batch)), **inputs(batch)}


LLAMA_TEXT = text("llama")
IDEFICS_TOKENS = (GRID // 2) ** 2  # a 2x pixel shuffle of the 4x4 patches

VLMS: dict[str, Tiny] = by_name(
    Tiny(
        "LlavaForConditionalGeneration",
        vlm_config(
            "LlavaConfig",
            vision_config=vision("CLIPVisionConfig"),
            text_config=LLAMA_TEXT,
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-2,
            vision_feature_select_strategy="full",
        ),
        "clip",
        features(pixels),
        prompt(lambda batch: 17 * batch, pixels),
    ),
    Tiny(
        "Idefics2ForConditionalGeneration",
        vlm_config(
            "Idefics2Config",
            vision_config=vision("Idefics2VisionConfig"),
            text_config=text("mistral"),
            perceiver_config=dict(
                hidden_size=64,
                resampler_n_latents=4,
                resampler_depth=1,
                resampler_n_heads=2,
                resampler_head_dim=8,
                num_key_value_heads=1,
            ),
            image_token_id=IMAGE_TOKEN,
        ),
        "idefics",
        features(image_sets),
        prompt(lambda batch: 4 * batch, image_sets),
    ),
    Tiny(
        "Idefics3ForConditionalGeneration",
        vlm_config(
            "Idefics3Config",
            vision_config=vision("Idefics3VisionConfig"),
            text_config=LLAMA_TEXT,
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        ),
        "idefics",
        features(image_sets),
        prompt(lambda batch: IDEFICS_TOKENS * batch, image_sets),
    ),
    Tiny(
        "SmolVLMForConditionalGeneration",
        vlm_config(
            "SmolVLMConfig",
            vision_config=vision("SmolVLMVisionConfig"),
            text_config=LLAMA_TEXT,
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        ),
        "idefics",
        features(image_sets),
        prompt(lambda batch: IDEFICS_TOKENS * batch, image_sets),
    ),
    Tiny(
        "LlavaNextForConditionalGeneration",
        vlm_config(
            "LlavaNextConfig",
            vision_config=vision("CLIPVisionConfig"),
            text_config=LLAMA_TEXT,
            image_token_index=IMAGE_TOKEN,
            image_grid_pinpoints=[[IMAGE, IMAGE]],
        ),
        "clip",
        features(llava_next_inputs),
    ),
    Tiny(
        "LlavaOnevisionForConditionalGeneration",
        vlm_config(
            "LlavaOnevisionConfig",
            vision_config=vision("SiglipVisionConfig"),
            text_config=text("qwen2"),
            image_token_index=IMAGE_TOKEN,
            image_grid_pinpoints=[[IMAGE, IMAGE]],
        ),
        "siglip",
        features(llava_next_inputs),
    ),
    Tiny(
        "LlavaNextVideoForConditionalGeneration",
        vlm_config(
            "LlavaNextVideoConfig",
            vision_config=vision("CLIPVisionConfig"),
            text_config=LLAMA_TEXT,
            image_token_index=IMAGE_TOKEN,
            video_token_index=IMAGE_TOKEN - 1,
            image_grid_pinpoints=[[IMAGE, IMAGE]],
        ),
        "clip",
        features(llava_next_inputs),
    ),
    Tiny(
        "VipLlavaForConditionalGeneration",
        vlm_config(
            "VipLlavaConfig",
            vision_config=vision("CLIPVisionConfig", num_hidden_layers=3),
            text_config=LLAMA_TEXT,
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=[-2, 1],
            vision_feature_layers=[-2, 1],  # its name before transformers 5.24
        ),
        "clip",
        features(pixels),
    ),
    Tiny(
        "PaliGemmaForConditionalGeneration",
        vlm_config(
            "PaliGemmaConfig",
            vision_config=vision("SiglipVisionConfig", projection_dim=64),
            text_config=text("gemma", num_key_value_heads=1, head_dim=16),
            image_token_index=IMAGE_TOKEN,
            projection_dim=64,
        ),
        "siglip",
        features(pixels),
    ),
    Tiny(
        "Gemma3ForConditionalGeneration",
        vlm_config(
            "Gemma3Config",
            vision_config=vision("SiglipVisionConfig"),
            text_config=text("gemma3_text", head_dim=16),
            mm_tokens_per_image=4,
            image_token_index=IMAGE_TOKEN,
            boi_token_index=IMAGE_TOKEN - 1,
            eoi_token_index=IMAGE_TOKEN - 2,
        ),
        "siglip",
        features(pixels),
    ),
    Tiny(
        "AyaVisionForConditionalGeneration",
        vlm_config(
            "AyaVisionConfig",
            vision_config=vision("SiglipVisionConfig"),
            text_config=text("cohere2"),
            image_token_index=IMAGE_TOKEN,
        ),
        "siglip",
        features(pixels),
    ),
    Tiny(
        "Cohere2VisionForConditionalGeneration",
        vlm_config(
            "Cohere2VisionConfig",
            vision_config=vision("SiglipVisionConfig"),
            text_config=text("cohere2"),
            image_token_id=IMAGE_TOKEN,
            alignment_intermediate_size=128,
        ),
        "siglip",
        features(pixels),
    ),
    Tiny(
        "DeepseekVLForConditionalGeneration",
        vlm_config(
            "DeepseekVLConfig",
            vision_config=vision("SiglipVisionConfig"),
            text_config=LLAMA_TEXT,
            image_token_id=IMAGE_TOKEN,
        ),
        "siglip",
        features(pixels, holder="model"),
    ),
    Tiny(
        "InternVLForConditionalGeneration",
        vlm_config(
            "InternVLConfig",
            vision_config=vision(
                "InternVLVisionConfig", image_size=[IMAGE, IMAGE], patch_size=[PATCH, PATCH]
            ),
            text_config=text("qwen2"),
            image_token_id=IMAGE_TOKEN,
            downsample_ratio=0.5,
            vision_feature_layer=-1,
        ),
        "internvl",
        features(pixels),
    ),
    Tiny(
        "JanusForConditionalGeneration",
        vlm_config(
            "JanusConfig",
            vision_config=vision("JanusVisionConfig", projection_dim=64),
            text_config=LLAMA_TEXT,
            vq_config=dict(
                embed_dim=8,
                num_embeddings=32,
                base_channels=32,
                channel_multiplier=[1, 1],
                num_res_blocks=1,
                latent_channels=8,
                projection_dim=64,
                image_token_embed_dim=64,
                num_patches=GRID,
            ),
            image_token_id=IMAGE_TOKEN,
        ),
        "janus",
        features(pixels, holder="model"),
        prompt(lambda batch: GRID * GRID * batch, pixels),
    ),
    Tiny(
        "Llama4ForConditionalGeneration",
        vlm_config(
            "Llama4Config",
            vision_config=llama4_vision_config,
            text_config=dict(
                TEXT,
                model_type="llama4_text",
                intermediate_size_mlp=128,
                head_dim=16,
                num_local_experts=2,
            ),
            image_token_index=IMAGE_TOKEN,
        ),
        "llama4",
        features(llama4_pixels),
        prompt(lambda batch: (GRID // 2) ** 2 * batch, llama4_pixels),
    ),
    Tiny(
        "MllamaForConditionalGeneration",
        vlm_config(
            "MllamaConfig",
            vision_config=mllama_vision_config,
            text_config=dict(
                TEXT,
                model_type="mllama_text_model",
                num_hidden_layers=2,
                cross_attention_layers=[1],
                vocab_size=VOCAB + 8,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
            ),
            image_token_index=IMAGE_TOKEN,
        ),
        "mllama",
        lambda model, batch: model(**mllama_prompts(batch)).logits,
        mllama_prompts,
    ),
    Tiny(
        "AriaForConditionalGeneration",
        vlm_config(
            "AriaConfig",
            vision_config=vision("Idefics3VisionConfig"),
            text_config=dict(
                TEXT,
                model_type="aria_text",
                moe_num_experts=2,
                moe_topk=1,
                moe_num_shared_experts=1,
            ),
            projector_patch_to_query_dict={GRID * GRID: 4},
            image_token_index=IMAGE_TOKEN,
        ),
        "idefics",
        features(pixels),
    ),
    Tiny(
        "DeepseekVLHybridForConditionalGeneration",
        vlm_config(
            "DeepseekVLHybridConfig",
            vision_config=vision("SiglipVisionConfig"),
            high_res_vision_config=dict(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=2 * IMAGE,
                patch_size=2 * PATCH,
                output_channels=16,
                global_attn_indexes=[0],
                window_size=0,
                mlp_dim=64,
            ),
            text_config=LLAMA_TEXT,
            image_token_id=IMAGE_TOKEN,
        ),
        "siglip",
        features(
            lambda batch: {
                "pixel_values": images(batch),
                "high_res_pixel_values": torch.randn(batch, 3, 2 * IMAGE, 2 * IMAGE),
            },
            holder="model",
        ),
    ),
    Tiny(
        "Cohere2VisionModel",
        vlm_config(
            "Cohere2VisionConfig",
            vision_config=vision("SiglipVisionConfig"),
            text_config=text("cohere2"),
            image_token_id=IMAGE_TOKEN,
            alignment_intermediate_size=128,
        ),
        "siglip",
        features(pixels),
    ),
    Tiny(
        "T5Gemma2ForConditionalGeneration",
        vlm_config(
            "T5Gemma2Config",
            encoder=lambda: dict(
                text_config=dict(TEXT, head_dim=16),
                vision_config=vision("SiglipVisionConfig")(),
                mm_tokens_per_image=4,
            ),
            decoder=dict(TEXT, head_dim=16),
            image_token_index=IMAGE_TOKEN,
        ),
        "siglip",
        features(pixels),
    ),
)
"""A tiny VLM of every family, by class name."""


ONE_LAYER_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
)
"""A dual encoder's tiny text encoder."""


def dual_config(config_name: str, vision_config: str, **settings: Any) -> Callable[[], Any]:
    """A tiny image-text dual encoder's configuration (a one-layer text encoder)."""
    return vlm_config(
        config_name, text_config=ONE_LAYER_TEXT, vision_config=vision(vision_config, **settings)
    )


QFORMER = dict(
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    intermediate_size=128,
    encoder_hidden_size=64,
    vocab_size=VOCAB,
)
"""A one-layer Q-Former, as BLIP-2 and InstructBLIP configurations take it."""
OPT_TEXT = dict(
    model_type="opt",
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    vocab_size=VOCAB,
    word_embed_proj_dim=64,
    max_position_embeddings=64,
)


def qformer_tokens(batch: int) -> dict[str, torch.Tensor]:
    """Pixels and the instruction tokens InstructBLIP's Q-Former reads with them."""
    return {**pixels(batch), "qformer_input_ids": torch.ones(batch, 4, dtype=torch.long)}


def video_qformer_tokens(batch: int) -> dict[str, torch.Tensor]:
    """``batch`` videos of two frames and their instruction tokens (InstructBLIP-Video)."""
    return {"pixel_values": images(batch, 2), "qformer_input_ids": torch.ones(batch, 4).long()}


def video_features(model: nn.Module, batch: int) -> torch.Tensor:
    return main_tensor(model.get_video_features(**video_qformer_tokens(batch)))


def text_with_pixels(model: nn.Module, batch: int) -> torch.Tensor:
    """A model's forward on ``batch`` images and a three-token text each: its first output."""
    ids = torch.tensor([[1, 2, 3]] * batch)
    out = model(pixel_values=images(batch), input_ids=ids)
    return out.logits if hasattr(out, "logits") else out[0]


BLIP_VLMS: dict[str, Tiny] = by_name(
    Tiny(
        "Blip2ForConditionalGeneration",
        vlm_config(
            "Blip2Config",
            vision_config=vision("Blip2VisionConfig"),
            qformer_config=QFORMER,
            text_config=OPT_TEXT,
            num_query_tokens=4,
            image_token_index=IMAGE_TOKEN,
        ),
        "blip",
        features(pixels),
    ),
    Tiny(
        "Blip2ForImageTextRetrieval",
        vlm_config(
            "Blip2Config",
            vision_config=vision("Blip2VisionConfig"),
            qformer_config=dict(QFORMER, use_qformer_text_input=True),
            text_config=OPT_TEXT,
            num_query_tokens=4,
            image_text_hidden_size=32,
        ),
        "blip",
        text_with_pixels,
    ),
    Tiny(
        "InstructBlipForConditionalGeneration",
        vlm_config(
            "InstructBlipConfig",
            vision_config=vision("InstructBlipVisionConfig"),
            qformer_config=QFORMER,
            text_config=OPT_TEXT,
            num_query_tokens=4,
            image_token_index=IMAGE_TOKEN,
        ),
        "blip",
        features(qformer_tokens),
    ),
    Tiny(
        "InstructBlipVideoForConditionalGeneration",
        vlm_config(
            "InstructBlipVideoConfig",
            vision_config=vision("InstructBlipVideoVisionConfig"),
            qformer_config=QFORMER,
            text_config=OPT_TEXT,
            num_query_tokens=4,
            video_token_index=IMAGE_TOKEN,
        ),
        "blip",
        video_features,
    ),
    Tiny(
        "BlipForConditionalGeneration",
        vlm_config(
            "BlipConfig",
            vision_config=vision("BlipVisionConfig"),
            text_config=dict(ONE_LAYER_TEXT, vocab_size=VOCAB, bos_token_id=1),
        ),
        "blip",
        text_with_pixels,
    ),
)
"""A tiny BLIP, BLIP-2 and InstructBLIP model of every class the coverage walk meets."""


DUALS: dict[str, Tiny] = by_name(
    Tiny(
        "SiglipModel", dual_config("SiglipConfig", "SiglipVisionConfig"), "siglip", features(pixels)
    ),
    Tiny("CLIPModel", dual_config("CLIPConfig", "CLIPVisionConfig"), "clip", features(pixels)),
    Tiny("Aimv2Model", dual_config("Aimv2Config", "Aimv2VisionConfig"), "aimv2", features(pixels)),
    Tiny(
        "MetaClip2Model",
        dual_config("MetaClip2Config", "MetaClip2VisionConfig"),
        "clip",
        features(pixels),
    ),
    Tiny(
        "AltCLIPModel",
        vlm_config(
            "AltCLIPConfig",
            text_config=dict(
                ONE_LAYER_TEXT, vocab_size=VOCAB, project_dim=32, max_position_embeddings=64
            ),
            vision_config=vision("AltCLIPVisionConfig"),
            projection_dim=32,
        ),
        "clip",
        features(pixels),
    ),
    Tiny(
        "ChineseCLIPModel",
        dual_config("ChineseCLIPConfig", "ChineseCLIPVisionConfig"),
        "clip",
        features(pixels),
    ),
    Tiny(
        "CLIPSegModel",
        dual_config("CLIPSegConfig", "CLIPSegVisionConfig"),
        "clip",
        features(pixels),
    ),
    Tiny(
        "Tipsv2Model",
        dual_config("Tipsv2Config", "Tipsv2VisionConfig"),
        "tipsv2",
        features(pixels),
    ),
    Tiny("BlipModel", dual_config("BlipConfig", "BlipVisionConfig"), "blip", features(pixels)),
)
"""A tiny image-text dual encoder of every family that has one, by class name."""


def retrieval_text() -> dict[str, Any]:
    """A two-layer ModernBERT, ModernVBERT's text model, with its special tokens in a tiny
    vocabulary (transformers 5.6's ModernBERT configuration refuses one layer, which holds no
    sliding-window layer)."""
    return dict(
        **{**ONE_LAYER_TEXT, "num_hidden_layers": 2},
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )


def any_dual_config(vision_config: str) -> Callable[[], Any]:
    """A tiny ``VisionTextDualEncoderConfig`` of a ``vision_config`` tower and a one-layer
    BERT."""

    def make() -> Any:
        vision_settings = dict(image_size=IMAGE, patch_size=PATCH, **WIDTH)
        return transformers_attr("VisionTextDualEncoderConfig").from_vision_text_configs(
            transformers_attr(vision_config)(**vision_settings),
            transformers_attr("BertConfig")(vocab_size=VOCAB, **ONE_LAYER_TEXT),
        )

    return make


def logits(model: nn.Module, batch: int) -> torch.Tensor:
    """An image classifier's logits for ``batch`` random images."""
    return model(pixel_values=images(batch)).logits


HEADS: dict[str, Tiny] = by_name(
    Tiny(
        "SiglipForImageClassification",
        vlm_config(
            "SiglipConfig",
            text_config=ONE_LAYER_TEXT,
            vision_config=vision("SiglipVisionConfig"),
            num_labels=3,
        ),
        "siglip",
        logits,
    ),
    Tiny(
        "CLIPForImageClassification",
        vlm_config(
            "CLIPConfig",
            text_config=ONE_LAYER_TEXT,
            vision_config=vision("CLIPVisionConfig"),
            num_labels=3,
        ),
        "clip",
        logits,
    ),
    Tiny(
        "VisionTextDualEncoderModel",
        any_dual_config("ViTConfig"),
        "vit",
        features(pixels),
    ),
    Tiny(
        "ModernVBertModel",
        vlm_config(
            "ModernVBertConfig",
            vision_config=vision("SiglipVisionConfig"),
            text_config=retrieval_text(),
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        ),
        "siglip",
        features(image_sets),
    ),
    Tiny(
        "ViTForImageClassification",
        tower_config("ViTConfig", num_labels=3, **WIDTH),
        "vit",
        logits,
    ),
    Tiny(
        "Dinov2ForImageClassification",
        tower_config("Dinov2Config", num_labels=3, **LAYERS),
        "dinov2",
        logits,
    ),
    Tiny(
        "DeiTForImageClassification",
        tower_config("DeiTConfig", num_labels=3, **WIDTH),
        "deit",
        logits,
    ),
    Tiny(
        "BeitForImageClassification",
        tower_config("BeitConfig", num_labels=3, **WIDTH),
        "beit",
        logits,
    ),
)
"""A tiny model of each class outside transformers' vision auto mappings that holds a served
tower under a head of its own: image classifiers, a dual encoder of any two towers, a
retrieval encoder."""
