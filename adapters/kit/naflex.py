"""The packed forward of a SigLIP2 NaFlex tower over one token budget: what its graphs hold.

transformers' ``Siglip2VisionModel`` runs a padded batch (``[images, max_patches, features]``)
with a mask. The ``siglip2`` adapter packs the real patches of a call into one sequence instead
(:mod:`layergraph_adapters.siglip2`), and this module computes the tower over such a sequence
from a budget's buffers (:class:`NaflexBuffers`), with shapes fixed by the budget alone:

- the patch embedding of the packed patches, plus their position embeddings, which the plan
  writes into the buffers before the replay (:mod:`layergraph_adapters.kit.grid_positions`);
- the encoder's layers, whose attention modules hand q, k and v to a backend that reads the
  boundaries from the buffers when it runs (the plan's routed attention), the backend prepared
  once per replay first (the dense backend, where the plan measured it faster for a budget,
  writes its block-diagonal mask of the boundaries then:
  :class:`~layergraph.attention.DenseMaskedAttention`);
- the final norm, and the attention-pooling head per image (:func:`pool`): the head's one
  probe attends to its image's tokens only.

What this module does not do: read calls, write the buffers, resize position embeddings or cut
outputs (the plan does), or run any eager call (those run the tower's own forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layergraph_adapters.kit.budget_buffers import BudgetBuffers

__all__ = ["NaflexBuffers", "packed_forward", "pool"]


@dataclass(eq=False)
class NaflexBuffers(BudgetBuffers):
    """One budget's buffers. The image boundaries live in the attention metadata
    (``cu_seqlens``, ``slots + 1``, and ``seq_lens`` where the backend takes them), from the
    ``attention_metadata`` hook. Image slots past a call's images are empty (their boundaries
    at its last token)."""

    slots: int
    positions: torch.Tensor
    """``[budget, width]``: each real patch's position embedding, zeros past them."""
    tokens: torch.Tensor
    """``0 .. budget - 1`` (int32): each token's place in the sequence."""


def packed_forward(tower: nn.Module, buffers: NaflexBuffers) -> tuple[torch.Tensor, Any]:
    """The tower over the budget's packed tokens: ``[budget, width]`` hidden states after the
    final norm, and ``[slots, width]`` pooled features (``None`` for a tower without a head).

    Attention runs through the plan's routed attention modules, which read the buffers bound
    around the call; the backend is prepared first, once (the dense backend writes its mask).
    """
    embedding = tower.embeddings.patch_embedding
    hidden = embedding(buffers.pixels.to(embedding.weight.dtype)) + buffers.positions
    buffers.backend.prepare(buffers.metadata, hidden)
    hidden = tower.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state
    hidden = tower.post_layernorm(hidden)
    pooled = pool(tower.head, hidden, buffers) if tower.use_head else None
    return hidden, pooled


def pool(head: nn.Module, hidden: torch.Tensor, buffers: NaflexBuffers) -> torch.Tensor:
    """The attention-pooling head (``Siglip2MultiheadAttentionPoolingHead``) of every image
    slot at once (``[slots, width]``): the head's probe attends to its image's tokens only,
    then the head's norm and MLP. An empty slot attends to every token (its row is cut off).

    Padding tokens, after the last boundary, belong to no slot, and are zeroed first: a varlen
    kernel that writes only the real sequences into fresh memory (FA3) leaves their attention
    output unwritten, and a masked key or value that is not finite still turns a softmax's zero
    weight into NaN."""
    image = torch.searchsorted(buffers.metadata.cu_seqlens[1:], buffers.tokens, right=True)
    hidden = torch.where((image < buffers.slots)[:, None], hidden, 0)
    attention = head.attention
    width = hidden.shape[-1]
    heads = attention.num_heads
    w_q, w_k, w_v = attention.in_proj_weight.chunk(3)
    b_q, b_k, b_v = attention.in_proj_bias.chunk(3)

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], heads, width // heads).transpose(0, 1)

    probe = split(F.linear(head.probe.view(1, width), w_q, b_q))
    keys, values = split(F.linear(hidden, w_k, b_k)), split(F.linear(hidden, w_v, b_v))
    slots = torch.arange(buffers.slots, device=hidden.device)
    empty = buffers.metadata.cu_seqlens.diff() == 0
    mask = (image[None, :] == slots[:, None]) | empty[:, None]
    out = F.scaled_dot_product_attention(
        probe.expand(heads, buffers.slots, -1), keys, values, attn_mask=mask
    )
    out = attention.out_proj(out.transpose(0, 1).reshape(buffers.slots, width))
    return out + head.mlp(head.layernorm(out))
