"""Attention backends and the metadata they need, for adapters that route attention.

A :class:`SequenceLayout` says which tokens belong together (a :class:`PackedLayout`, how many
sequences and tokens a packed plan's graph has room for, their boundaries written at every
call); a backend turns it into the metadata its kernel takes (through the
``attention_metadata`` hook, so plugins can supply metadata for other backends or layouts) and
computes attention over packed
``[tokens, heads, head_dim]`` views. Backends are registered by plugins (the built-in ones by
layergraph's own) and found through the plugin registry. The runner knows none of this:
adapters use it.
"""

from .backends import (
    AttentionBackend,
    AttentionBackendFailed,
    DenseMaskedAttention,
    Fa3Attention,
    PackedTimer,
    SdpaAttention,
    SdpaMaskedAttention,
    TritonVarlenAttention,
    block_mask,
    choose_backend,
    choose_packed_backend,
    packed_backends,
    packed_timer,
)
from .cudnn_ragged import CudnnRaggedAttention
from .layout import (
    AttentionMetadata,
    PackedLayout,
    SequenceLayout,
    build_metadata,
    check_packed_metadata,
    padded_offsets,
)

__all__ = [
    "AttentionBackend",
    "AttentionBackendFailed",
    "AttentionMetadata",
    "CudnnRaggedAttention",
    "DenseMaskedAttention",
    "Fa3Attention",
    "PackedLayout",
    "PackedTimer",
    "SdpaAttention",
    "SdpaMaskedAttention",
    "SequenceLayout",
    "TritonVarlenAttention",
    "block_mask",
    "build_metadata",
    "check_packed_metadata",
    "choose_backend",
    "choose_packed_backend",
    "packed_backends",
    "packed_timer",
    "padded_offsets",
]
