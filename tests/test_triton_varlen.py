"""The Triton varlen attention kernel against a float64 reference, one softmax per sequence.

Without a GPU the kernel runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set
below before Triton is imported); with one, the same tests run the compiled kernel on CUDA.

Tolerances, on the relative error ``||out - ref|| / ||ref||`` against float64 attention of the
same (rounded) inputs: 1e-5 in float32 (float32 throughout, dots in IEEE mode; about 1e-7 is
seen), 2e-3 in float16 (the probabilities are rounded to float16 before the second dot and the
output is rounded once: a few 1e-4 is seen), 1e-2 in bfloat16 (the same with 8 mantissa bits,
about 8 times float16's error). bfloat16 runs on CUDA only: Triton's interpreter computes
``tl.dot`` on the bit patterns of bfloat16 operands as integers (``create_dot`` in
``triton/runtime/interpreter.py``, seen in Triton 3.8), so its results are meaningless.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layergraph.attention import triton_varlen
from layergraph.attention.triton_varlen import (
    VarlenConfig,
    default_config,
    head_dim_tiles,
    varlen_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        DEVICE.type != "cuda",
        reason="Triton's interpreter computes tl.dot on bfloat16 bit patterns as integers",
    ),
)
pytestmark = pytest.mark.usefixtures("runnable_triton")
SMALL = VarlenConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)


def metadata(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(seq_lens, 0)
    return cu_seqlens.to(DEVICE), seq_lens.to(DEVICE)


def make_qkv(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of shape [tokens, heads, head_dim] laid out in memory as ``layout`` says."""
    shape = (tokens, heads, head_dim)
    if layout == "packed":  # slices of one fused projection: [tokens, 3, heads, head_dim]
        qkv = torch.randn(tokens, 3 * heads * head_dim, device=DEVICE, dtype=dtype)
        return qkv.view(tokens, 3, heads, head_dim).unbind(1)
    if layout == "head_major":  # [heads, tokens, head_dim] transposed
        return tuple(
            torch.randn(heads, tokens, head_dim, device=DEVICE, dtype=dtype).transpose(0, 1)
            for _ in range(3)
        )
    if layout == "padded":  # rows padded by 8 elements, heads padded by one row
        return tuple(
            torch.randn(tokens, heads + 1, head_dim + 8, device=DEVICE, dtype=dtype)[
                :, :heads, :head_dim
            ]
            for _ in range(3)
        )
    return tuple(torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(3))


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> torch.Tensor:
    """Float64 attention of each sequence to itself, [tokens, heads, head_dim]."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        qs, ks, vs = (t[rows].double().transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[rows] = (weights @ vs).transpose(0, 1)
        start += n
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_case(
    lengths: list[int],
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    layout: str = "packed",
    config: VarlenConfig | None = None,
    max_seqlen: int | None = None,
    spare_rows: int = 0,
) -> None:
    """Run the kernel into a NaN-poisoned ``out`` and check every row against the reference."""
    torch.manual_seed(sum(lengths) + heads + head_dim)
    tokens = sum(lengths) + spare_rows
    q, k, v = make_qkv(tokens, heads, head_dim, dtype, layout)
    out = torch.full((tokens, heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    cu_seqlens, seq_lens = metadata(lengths)
    scale = head_dim**-0.5
    result = varlen_attention(
        q, k, v, out, cu_seqlens, seq_lens, max_seqlen or max(lengths), scale, config=config
    )
    assert result is out
    used = sum(lengths)
    assert not out[:used].isnan().any(), "some output elements were not written"
    assert out[used:].isnan().all(), "rows outside every sequence were written"
    error = relative_error(out[:used], reference(q, k, v, lengths, scale)[:used])
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize(
    "dtype", [torch.float16, BF16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_packed_sequences_match_reference(head_dim: int, dtype: torch.dtype) -> None:
    run_case([5, 17, 1, 33], heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("lengths", "heads", "head_dim", "config"),
    [
        ([5, 17, 1, 33], 2, 64, SMALL),  # several query blocks, full and ragged key blocks
        ([48, 32], 3, 96, SMALL),  # lengths multiples of both blocks: no ragged block
        ([40, 7, 23], 2, 72, VarlenConfig(block_m=32, block_n=16)),  # head dim padded to 128
        ([130], 1, 64, None),  # one row past a 128-row query block, two keys past 128
        ([3, 0, 9], 2, 64, SMALL),  # an empty sequence
        # Longest one past a whole 64-row block: whole blocks, then the rest in 16-row blocks
        # (a sequence shorter than a block, one 36 rows past one, one of exactly one block).
        ([65, 100, 3, 64, 0, 129], 2, 64, VarlenConfig(block_m=64, block_n=64)),
        ([197, 37], 2, 64, None),  # vit_base's 197 tokens: 5 past three blocks
        ([90], 1, 64, None),  # 26 rows past a block: one launch; 26 keys in two 16-key blocks
    ],
)
def test_block_boundaries(
    lengths: list[int], heads: int, head_dim: int, config: VarlenConfig | None, dtype: torch.dtype
) -> None:
    run_case(lengths, heads, head_dim, dtype, config=config)


@pytest.mark.parametrize(
    ("lengths", "config"),
    [
        ([5, 17, 1, 33, 9], SMALL),  # three parts of two, two and one sequences
        ([65, 100, 3, 64, 0, 129], VarlenConfig(block_m=64, block_n=64)),  # and the tail launch
    ],
)
def test_more_sequences_times_heads_than_a_grid_holds_are_launched_in_parts(
    lengths: list[int], config: VarlenConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grid's second dimension holds 65,535 programs (a sequence and head each); a room of
    more, a long video's frames, is launched in parts of whole sequences. The limit is lowered
    here to 5, two sequences of two heads a part, so that the interpreter runs it quickly."""
    monkeypatch.setattr(triton_varlen, "_MAX_GRID_Y", 5)
    run_case(lengths, heads=2, head_dim=64, dtype=torch.float16, config=config)


SPLIT = VarlenConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, split_head_dim=True)


@pytest.mark.parametrize(
    "dtype", [torch.float16, BF16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("head_dim", [40, 48, 72, 80, 96, 112, 144])
def test_a_head_dim_split_in_two_tiles_matches_reference(head_dim: int, dtype: torch.dtype) -> None:
    run_case([5, 17, 1, 33], heads=2, head_dim=head_dim, dtype=dtype, config=SPLIT)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_split_head_dim_reads_strided_views(layout: str) -> None:
    run_case([9, 20], heads=3, head_dim=80, dtype=torch.float16, layout=layout, config=SPLIT)


def test_a_head_dim_is_split_only_into_two_whole_tiles() -> None:
    """No tile of a split head dim has columns past it: the kernel loads and stores both
    without column masks."""
    tiles = {d: head_dim_tiles(d, split=True) for d in (16, 40, 48, 64, 72, 80, 96, 112, 144)}
    assert tiles == {
        16: (16, 0),
        40: (64, 0),
        48: (32, 16),
        64: (64, 0),
        72: (128, 0),
        80: (64, 16),
        96: (64, 32),
        112: (128, 0),
        144: (128, 16),
    }
    assert head_dim_tiles(80, split=False) == (128, 0)
    for head_dim in range(16, 257, 8):
        first, second = head_dim_tiles(head_dim, split=True)
        if second:
            assert first + second == head_dim and 16 <= second < first
        else:
            assert first >= head_dim and first & (first - 1) == 0


def test_the_default_config_splits_where_the_head_dim_has_two_whole_tiles() -> None:
    assert default_config(80).split_head_dim and default_config(96).split_head_dim
    assert not default_config(72).split_head_dim and not default_config(128).split_head_dim
    assert default_config(72).block_m == default_config(80).block_m == 128


@pytest.mark.parametrize("layout", ["contiguous", "packed", "head_major", "padded"])
def test_strided_views(layout: str) -> None:
    run_case([9, 20], heads=3, head_dim=80, dtype=torch.float16, layout=layout, config=SMALL)


def test_larger_max_seqlen_and_spare_rows_are_left_alone() -> None:
    """A graph captured for longer sequences, replayed with fewer tokens than the buffers hold."""
    run_case([6, 11], heads=2, head_dim=64, dtype=torch.float16, max_seqlen=64, spare_rows=5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("heads", "head_dim"), [(16, 64), (16, 80), (12, 96), (8, 128)])
def test_vision_encoder_shapes(heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Eight 448x448 InternViT tiles (1025 tokens) and a smaller image, default configs."""
    run_case([1025] * 7 + [257], heads, head_dim, dtype)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay() -> None:
    lengths, heads, head_dim = [300, 1025, 17], 4, 64
    q, k, v = make_qkv(sum(lengths), heads, head_dim, torch.bfloat16, "packed")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    cu_seqlens, seq_lens = metadata(lengths)

    def call() -> torch.Tensor:
        return varlen_attention(q, k, v, out, cu_seqlens, seq_lens, 1025, head_dim**-0.5)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        error = relative_error(out, reference(q, k, v, lengths, head_dim**-0.5))
        assert error < TOLERANCE[torch.bfloat16], f"relative error {error:.2e}"


def test_default_configs() -> None:
    for head_dim in (64, 80, 96, 128, 256):
        config = default_config(head_dim)
        assert config.block_m >= 16 and config.block_n >= 16


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        VarlenConfig(block_m=64, block_n=48)
    with pytest.raises(ValueError, match="at least 16"):
        VarlenConfig(block_m=8, block_n=16)
    with pytest.raises(ValueError, match="num_stages"):
        VarlenConfig(block_m=64, block_n=64, num_stages=0)


def _valid_args() -> dict[str, Any]:
    q, k, v = make_qkv(10, 2, 64, torch.float16, "packed")
    cu_seqlens, seq_lens = metadata([4, 6])
    out = torch.empty(10, 2, 64, device=DEVICE, dtype=torch.float16)
    return dict(
        q=q, k=k, v=v, out=out, cu_seqlens=cu_seqlens, seq_lens=seq_lens, max_seqlen=6, scale=0.125
    )


@pytest.mark.parametrize(
    ("names", "change", "message"),
    [
        ("k", lambda t: t.float(), "k dtype torch.float32 differs from q dtype torch.float16"),
        ("q", lambda t: t.to(torch.int16), "q dtype must be float16, bfloat16 or float32"),
        ("v", lambda t: t[:9], r"v shape \(9, 2, 64\) differs from q shape \(10, 2, 64\)"),
        ("out", lambda t: t.float(), "out dtype torch.float32 differs"),
        ("out", lambda t: t[:, :1], r"out shape \(10, 1, 64\) differs"),
        ("k", lambda t: t.reshape(10, 128), r"k must be \[total_tokens, heads, head_dim\]"),
        ("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "q last dimension"),
        ("q k v out", lambda t: t[..., :36], "unsupported head_dim 36"),
        ("cu_seqlens", lambda t: t.long(), "cu_seqlens dtype must be torch.int32"),
        ("seq_lens", lambda t: t.long(), "seq_lens dtype must be torch.int32"),
        ("cu_seqlens", lambda t: t[:2], r"cu_seqlens must have len\(seq_lens\) \+ 1 = 3"),
        ("seq_lens", lambda t: t.view(1, 2), "seq_lens must be a contiguous 1-D tensor"),
        ("max_seqlen", lambda n: 0, "max_seqlen must be a positive Python int"),
        ("max_seqlen", lambda n: 6.0, "max_seqlen must be a positive Python int"),
    ],
)
def test_validation_errors(names: str, change: Callable[[Any], Any], message: str) -> None:
    args = _valid_args()
    for name in names.split():
        args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        varlen_attention(**args)
