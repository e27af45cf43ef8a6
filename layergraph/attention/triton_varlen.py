"""Variable-length (packed sequences) flash-attention forward in Triton, for vision encoders.

A batch of images or tiles whose token counts differ is packed into one tensor of
``total_tokens`` rows; ``cu_seqlens`` marks where each sequence starts. Each sequence attends to
itself only (a block-diagonal mask and no other), computed with the online softmax of flash
attention: float32 accumulation, ``exp2`` with ``log2(e)`` folded into the scale, one program per
(query block, sequence, head). Keys past a sequence's last whole key block are taken in 16-key
blocks; when ``max_seqlen`` is at most 16 rows past a whole query block (a class token's 197,
577 or 1025 tokens) and the whole blocks fill the GPU several times over, a second launch
computes the rows past each sequence's last whole block in 16-row blocks, so that one extra
token does not cost a whole block. The launches do no
device-to-host synchronisation and allocate nothing, so they can be captured inside a CUDA
graph; the grids are fixed by ``max_seqlen`` and the number of sequences, and programs whose
query block lies past their sequence's end exit at once. More sequences times heads than a
grid's second dimension holds (65,535) are launched in parts of whole sequences. Compile
before capturing: the first call with a new dtype, head dim or config compiles.
The launch is the PyTorch operator ``torch.ops.layergraph.varlen_attention``, so that
``torch.compile`` keeps it as one opaque call inside a compiled layer.

What it does not do: no causal or other masks, no dropout, no attention bias, no grouped or
multi-query heads (q, k and v have the same number of heads), no backward pass, no returned
log-sum-exp. ``max_seqlen`` is trusted, not checked: in a sequence longer than it, the query
rows past the grid's last query block are silently left unwritten.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["VarlenConfig", "default_config", "head_dim_tiles", "varlen_attention"]

_LOG2_E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_GRID_Y = 65535
_TAIL = 16
"""Rows and keys of the narrow blocks that finish a sequence whose length is not a multiple
of the block size: a ViT's class token makes 197, 577 or 1025 tokens, one past a multiple of
64, and a whole block for that one row or key would cost a seventeenth of the work at 1025."""
_FULL_WAVES = 4
"""Programs per multiprocessor from which the narrow last rows get a launch of their own."""
_ALL_ROWS, _WHOLE_BLOCKS, _TAIL_ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
"""Which query rows a launch computes: every block, the whole blocks only, or the rows after
the last whole block (in ``_TAIL``-row blocks)."""


@dataclass(frozen=True)
class VarlenConfig:
    """Launch configuration: query and key block sizes, warps per program, pipeline depth."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    split_head_dim: bool = False
    """Take a head dim that is the sum of two powers of two in two tiles of those widths (80 as
    64 + 16, 96 as 64 + 32) instead of padding it to the next power of two; other head dims
    (72, say) are padded whatever this says (:func:`head_dim_tiles`)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"VarlenConfig.{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(
                f"VarlenConfig block sizes must be at least 16 (tl.dot), got "
                f"block_m={self.block_m}, block_n={self.block_n}"
            )
        if self.num_stages < 1:
            raise ValueError(f"VarlenConfig.num_stages must be at least 1, got {self.num_stages}")


def default_config(head_dim: int) -> VarlenConfig:
    """The block sizes, warps and stages used for ``head_dim`` unless a config is given.

    Chosen on an H200 with ``benchmarks/attention_kernel.py`` (docs/benchmark-runs.md), bf16:
    64-row query blocks (less work lost on the ragged last query block than with 128, and as
    fast per block), 4 warps, 3 stages; 64-key blocks up to head dim 64, 32-key blocks at 128.
    Between 64 and 128 (measured at 72 and 80), 128-row query blocks of 64 keys, and the head
    dim in two tiles where it is the sum of two powers of two (80 as 64 + 16). Untried above
    head dim 128.
    """
    if head_dim <= 64:
        return VarlenConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    if head_dim < 128:
        split = head_dim_tiles(head_dim, split=True)[1] > 0
        return VarlenConfig(
            block_m=128, block_n=64, num_warps=4, num_stages=3, split_head_dim=split
        )
    if head_dim == 128:
        return VarlenConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)
    return VarlenConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@triton.jit
def _load_tile(
    ptrs,
    rows,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_D: tl.constexpr,
):
    """Load a [rows, BLOCK_D] tile, masking only what the constexpr flags say may be out."""
    if MASK_D:
        mask = offs_d[None, :] < HEAD_DIM
        if MASK_ROWS:
            mask = mask & (rows[:, None] < n_rows)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif MASK_ROWS:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend_block(
    acc,
    acc2,
    l_i,
    m_i,
    q,
    q2,
    k_ptrs,
    v_ptrs,
    k2_ptrs,
    v2_ptrs,
    start_n,
    seq_len,
    offs_n,
    offs_d,
    offs_d2,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the key block starting at ``start_n``; with ``SPLIT``,
    the head dim's second tile (``q2``, ``acc2``, ``k2_ptrs``, ``v2_ptrs``, ``offs_d2``) too,
    else those are ignored and ``acc2`` comes back as it came."""
    cols = start_n + offs_n
    k = _load_tile(k_ptrs, cols, seq_len, offs_d, HEAD_DIM, MASK_N, MASK_D)
    v = _load_tile(v_ptrs, cols, seq_len, offs_d, HEAD_DIM, MASK_N, MASK_D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SPLIT:
        k2 = _load_tile(k2_ptrs, cols, seq_len, offs_d2, HEAD_DIM, MASK_N, False)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PRECISION)
    qk = qk * qk_scale
    if MASK_N:
        qk = tl.where(cols[None, :] < seq_len, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    if SPLIT:
        v2 = _load_tile(v2_ptrs, cols, seq_len, offs_d2, HEAD_DIM, MASK_N, False)
        acc2 = acc2 * alpha[:, None]
        acc2 = tl.dot(p.to(v2.dtype), v2, acc2, input_precision=DOT_PRECISION)
    return acc, acc2, l_i, m_new


@triton.jit
def _varlen_fwd_kernel(
    Q,
    K,
    V,
    Out,
    cu_seqlens,
    seq_lens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    heads,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TAIL_N: tl.constexpr,
    QUERY_ROWS: tl.constexpr,
    WHOLE_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    seq_len = tl.load(seq_lens + batch)
    if QUERY_ROWS == _TAIL_ROWS:  # the rows after the sequence's last whole WHOLE_M block
        start_m = (seq_len // WHOLE_M) * WHOLE_M + block_m * BLOCK_M
    else:
        start_m = block_m * BLOCK_M
    if QUERY_ROWS == _WHOLE_BLOCKS:
        if start_m + BLOCK_M > seq_len:
            return
    elif start_m >= seq_len:
        return
    seq_start = tl.load(cu_seqlens + batch).to(tl.int64)
    SPLIT: tl.constexpr = BLOCK_D2 > 0
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM and not SPLIT
    MASK_M: tl.constexpr = QUERY_ROWS != _WHOLE_BLOCKS

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_tail = tl.arange(0, TAIL_N)
    offs_d = tl.arange(0, BLOCK_D)
    # The second tile of a split head dim; without a split, the first tile again, unused.
    # A block, not a conditional expression: Triton compiles the branch a constexpr takes.
    if SPLIT:  # noqa: SIM108
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
    else:
        offs_d2 = offs_d
    q_base = Q + seq_start * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt
    k_row = K + seq_start * stride_kt + head * stride_kh
    v_row = V + seq_start * stride_vt + head * stride_vh
    k_base, k2_base = k_row + offs_d[None, :], k_row + offs_d2[None, :]
    v_base, v2_base = v_row + offs_d[None, :], v_row + offs_d2[None, :]

    q = _load_tile(q_base + offs_d[None, :], offs_m, seq_len, offs_d, HEAD_DIM, MASK_M, MASK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPLIT:
        q2_ptrs = q_base + offs_d2[None, :]
        q2 = _load_tile(q2_ptrs, offs_m, seq_len, offs_d2, HEAD_DIM, MASK_M, False)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    else:
        q2 = q
        acc2 = acc
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Whole key blocks without row masks.
    full_end = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        rows = (start_n + offs_n[:, None]) * stride_kt
        v_rows = (start_n + offs_n[:, None]) * stride_vt
        acc, acc2, l_i, m_i = _attend_block(
            acc,
            acc2,
            l_i,
            m_i,
            q,
            q2,
            k_base + rows,
            v_base + v_rows,
            k2_base + rows,
            v2_base + v_rows,
            start_n,
            seq_len,
            offs_n,
            offs_d,
            offs_d2,
            qk_scale,
            HEAD_DIM,
            False,
            MASK_D,
            SPLIT,
            DOT_PRECISION,
        )
    # The ragged last keys, in narrower TAIL_N blocks with row masks.
    for start_n in range(full_end, seq_len, TAIL_N):
        rows = (start_n + offs_tail[:, None]) * stride_kt
        v_rows = (start_n + offs_tail[:, None]) * stride_vt
        acc, acc2, l_i, m_i = _attend_block(
            acc,
            acc2,
            l_i,
            m_i,
            q,
            q2,
            k_base + rows,
            v_base + v_rows,
            k2_base + rows,
            v2_base + v_rows,
            start_n,
            seq_len,
            offs_tail,
            offs_d,
            offs_d2,
            qk_scale,
            HEAD_DIM,
            True,
            MASK_D,
            SPLIT,
            DOT_PRECISION,
        )

    o_base = Out + seq_start * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot
    out = acc / l_i[:, None]
    _store_tile(o_base + offs_d[None, :], out, offs_m, seq_len, offs_d, HEAD_DIM, MASK_M, MASK_D)
    if SPLIT:
        out2 = acc2 / l_i[:, None]
        o2_ptrs = o_base + offs_d2[None, :]
        _store_tile(o2_ptrs, out2, offs_m, seq_len, offs_d2, HEAD_DIM, MASK_M, False)


@triton.jit
def _store_tile(
    ptrs,
    tile,
    rows,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_D: tl.constexpr,
):
    """Store a [rows, BLOCK_D] tile, masking only what the constexpr flags say may be out."""
    value = tile.to(ptrs.dtype.element_ty)
    if MASK_D:
        mask = offs_d[None, :] < HEAD_DIM
        if MASK_ROWS:
            mask = mask & (rows[:, None] < n_rows)
        tl.store(ptrs, value, mask=mask)
    elif MASK_ROWS:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, value)


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen: int,
) -> None:
    """Raise ValueError naming the first thing wrong; reads metadata only (no device sync)."""
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be [total_tokens, heads, head_dim], got shape {tuple(t.shape)}"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.shape != q.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from q shape {tuple(q.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} last dimension must have stride 1, got {t.stride(-1)}")
    head_dim = q.shape[-1]
    if not (16 <= head_dim <= 256 and head_dim % 8 == 0):
        raise ValueError(
            f"unsupported head_dim {head_dim}: must be a multiple of 8 between 16 and 256"
        )
    for name, t in (("cu_seqlens", cu_seqlens), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} dtype must be torch.int32, got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if cu_seqlens.numel() != seq_lens.numel() + 1:
        raise ValueError(
            f"cu_seqlens must have len(seq_lens) + 1 = {seq_lens.numel() + 1} elements, "
            f"got {cu_seqlens.numel()}"
        )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive Python int, got {max_seqlen!r}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    *,
    config: VarlenConfig | None = None,
) -> torch.Tensor:
    """Attention of each packed sequence to itself, written into ``out``, which is returned.

    ``q``, ``k``, ``v`` and ``out`` are ``[total_tokens, heads, head_dim]`` of one dtype
    (float16, bfloat16, or float32 for testing), any strides with the last one 1. Sequence
    ``b`` holds rows ``cu_seqlens[b]`` to ``cu_seqlens[b] + seq_lens[b]`` (both int32 on the
    device); no length may exceed ``max_seqlen``. Rows of ``out`` outside every sequence are
    left as they were. ``scale`` multiplies ``q @ k^T`` before the softmax (usually
    ``head_dim ** -0.5``); ``config`` overrides :func:`default_config`.
    """
    _check_args(q, k, v, out, cu_seqlens, seq_lens, max_seqlen)
    batch, heads, head_dim = seq_lens.numel(), q.shape[1], q.shape[2]
    if batch == 0 or heads == 0 or q.shape[0] == 0:
        return out
    cfg = config or default_config(head_dim)
    torch.ops.layergraph.varlen_attention(
        q,
        k,
        v,
        out,
        cu_seqlens,
        seq_lens,
        max_seqlen,
        scale,
        cfg.block_m,
        cfg.block_n,
        cfg.num_warps,
        cfg.num_stages,
        cfg.split_head_dim,
    )
    return out


def head_dim_tiles(head_dim: int, split: bool) -> tuple[int, int]:
    """The widths of the kernel's head-dim tiles for ``head_dim``: one tile of the next power
    of two (at least 16) and no second, or with ``split`` where ``head_dim`` is the largest
    power of two below it plus a power of two of at least 16 (what ``tl.dot`` takes), those
    two, so that neither tile has columns past the head dim: 80 as (64, 16), 96 as (64, 32),
    48 as (32, 16); 72 stays (128, 0), its rest of 8 being too narrow for a tile of its own."""
    whole = max(16, triton.next_power_of_2(head_dim))
    if not split or whole == head_dim:
        return whole, 0
    first = whole // 2
    rest = head_dim - first
    exact = rest >= 16 and rest & (rest - 1) == 0
    return (first, rest) if exact else (whole, 0)


@torch.library.custom_op("layergraph::varlen_attention", mutates_args=("out",))
def _varlen_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    split_head_dim: bool = False,
) -> None:
    """The kernel launch as a PyTorch operator, opaque to ``torch.compile``.

    Compiling a layer that calls :func:`varlen_attention` (``wrap(..., compile_layers=True)``)
    then keeps this launch as it is instead of re-generating the kernel through Inductor.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    block_d, block_d2 = head_dim_tiles(head_dim, split_head_dim)
    sequences = seq_lens.numel()
    split = _splits_last_rows(max_seqlen, block_m, sequences * heads, q.device)
    launches = (
        [(max_seqlen // block_m, block_m, _WHOLE_BLOCKS), (block_m // _TAIL, _TAIL, _TAIL_ROWS)]
        if split
        else [(triton.cdiv(max_seqlen, block_m), block_m, _ALL_ROWS)]
    )
    # The grid's second dimension holds at most _MAX_GRID_Y programs: more sequences times
    # heads than that are launched in parts of whole sequences (views: nothing allocated).
    per_part = max(1, _MAX_GRID_Y // heads)
    parts = [(first, min(per_part, sequences - first)) for first in range(0, sequences, per_part)]
    for (blocks, rows, query_rows), (first, count) in itertools.product(launches, parts):
        if blocks == 0:
            continue
        _varlen_fwd_kernel[(blocks, count * heads)](
            q,
            k,
            v,
            out,
            cu_seqlens[first:],
            seq_lens[first : first + count],
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            heads,
            scale * _LOG2_E,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_D2=block_d2,
            BLOCK_M=rows,
            BLOCK_N=block_n,
            TAIL_N=min(_TAIL, block_n),
            QUERY_ROWS=query_rows.value,
            WHOLE_M=block_m,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
            num_warps=num_warps,
            num_stages=num_stages,
        )


def _splits_last_rows(
    max_seqlen: int, block_m: int, sequences_heads: int, device: torch.device
) -> bool:
    """Whether the rows past the last whole query block get a launch of narrow blocks.

    Only when ``max_seqlen`` is at most :data:`_TAIL` rows past a whole block, and on a GPU
    only when the whole blocks fill it several times over: with fewer, the ragged blocks run
    beside the others in one launch at no cost, where a second launch would wait for the first.
    """
    if not (block_m > _TAIL and 0 < max_seqlen % block_m <= _TAIL):
        return False
    if device.type != "cuda":
        return True
    programs = max_seqlen // block_m * sequences_heads
    return programs >= _FULL_WAVES * _multiprocessors(device.index or 0)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@_varlen_attention_op.register_fake
def _(*_args: object) -> None:
    return None
