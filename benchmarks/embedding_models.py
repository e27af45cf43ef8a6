"""The image-embedding models the open_clip and serving benchmarks run, built from their
configurations with random weights (nothing downloaded).

open_clip models come from ``open_clip.create_model(name, pretrained=None)``; the
sentence-transformers ones are transformers CLIPs of the shapes of clip-ViT-B-32 and
clip-ViT-L-14, saved with an image processor and a letters-only tokenizer into a folder that
``SentenceTransformer(folder)`` loads, as a user's local checkpoint would be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

OPEN_CLIP_MODELS = (
    "ViT-B-32",
    "ViT-L-14",
    "ViT-L-14-336",
    "ViT-H-14",
    "ViT-SO400M-14-SigLIP",
    "ViT-SO400M-14-SigLIP-384",
    "coca_ViT-L-14",
)
"""The open_clip architectures measured by default."""

SENTENCE_TRANSFORMERS_CLIPS: dict[str, dict[str, Any]] = {
    "clip-ViT-B-32": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
        projection_dim=512,
    ),
    "clip-ViT-L-14": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=224,
        patch_size=14,
        projection_dim=768,
    ),
}
"""The vision configurations of sentence-transformers' CLIP checkpoints."""


def open_clip_model(name: str, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """open_clip's ``name`` with random weights, in eval mode on ``device`` in ``dtype``."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model(name, pretrained=None)
    return model.to(device, dtype).eval()


def image_size(model: torch.nn.Module) -> tuple[int, int]:
    """The image size an open_clip model's tower takes."""
    visual = model.visual
    size = visual.image_size if hasattr(visual, "image_size") else None
    if size is None:
        size = tuple(visual.trunk.patch_embed.img_size)
    return (size, size) if isinstance(size, int) else tuple(size)


def save_clip(directory: Path, vision: dict[str, Any]) -> Path:
    """A random transformers CLIP whose tower is ``vision`` (``projection_dim`` included),
    with its image processor and a letters-only tokenizer, saved where
    ``SentenceTransformer(directory)`` loads it."""
    import transformers

    vision = dict(vision)
    projection_dim = vision.pop("projection_dim", 16)
    torch.manual_seed(0)
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config = transformers.CLIPConfig(
        text_config=text, vision_config=vision, projection_dim=projection_dim
    )
    directory.mkdir(parents=True, exist_ok=True)
    transformers.CLIPModel(config).eval().save_pretrained(directory)
    side = vision["image_size"]
    transformers.CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    ).save_pretrained(directory)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in map(chr, range(97, 123)):
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    transformers.CLIPTokenizer(
        str(directory / "vocab.json"), str(directory / "merges.txt")
    ).save_pretrained(directory)
    return directory
