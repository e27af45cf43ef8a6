"""The fused rotary kernel against the eager composition transformers' vision towers run.

Without a GPU the kernel runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set
below before Triton is imported); with one, the same tests run the compiled kernel on CUDA.

The reference is ``apply_rotary_pos_emb_vision`` as Qwen2.5-VL's and GLM-4.1V's modules write
it: q and k cast to float32, ``x * cos + rotate_half(x) * sin``, cast back. Tolerances, element
by element, ``|got - want| <= atol + rtol * |want|``: ``rtol`` twice the dtype's machine
epsilon (both round a float32 result once; the kernel may fuse a multiply and an add, and
Triton's interpreter rounds toward zero where the GPU rounds to nearest), ``atol`` 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layergraph.kernels.rotary import rotate_queries_and_keys

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (
        ((q * cos) + (rotate_half(q) * sin)).to(dtype),
        ((k * cos) + (rotate_half(k) * sin)).to(dtype),
    )


def angles(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the towers make them: frequencies repeated over both halves."""
    positions = torch.randint(0, 64, (tokens, head_dim // 4)).float()
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim // 4).float() / (head_dim // 4)))
    freqs = torch.cat([positions * inverse, positions.flip(-1) * inverse], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1).to(DEVICE)
    return emb.cos(), emb.sin()


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [(16, 80), (16, 72), (12, 64), (1, 40), (3, 128)])
def test_views_of_a_fused_projection_rotate_as_eager(
    dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    tokens = 37
    qkv = torch.randn(tokens, 3 * heads * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.view(tokens, 3, heads, head_dim).unbind(1)
    cos, sin = angles(tokens, head_dim)
    got_q, got_k = rotate_queries_and_keys(q, k, cos, sin)
    want_q, want_k = eager(q, k, cos, sin)
    assert got_q.is_contiguous() and got_q.dtype == dtype
    torch.testing.assert_close(got_q, want_q, **tolerance(dtype))
    torch.testing.assert_close(got_k, want_k, **tolerance(dtype))


def test_unequal_halves_of_cos_and_sin_are_read_apart() -> None:
    """Nothing assumes the two halves of cos and sin are equal."""
    tokens, heads, head_dim = 5, 2, 16
    q, k = (torch.randn(tokens, heads, head_dim, device=DEVICE) for _ in range(2))
    cos, sin = (torch.randn(tokens, head_dim, device=DEVICE) for _ in range(2))
    for got, want in zip(rotate_queries_and_keys(q, k, cos, sin), eager(q, k, cos, sin)):
        torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_no_tokens_give_empty_results() -> None:
    q = torch.randn(0, 4, 8, device=DEVICE)
    cos = torch.randn(0, 8, device=DEVICE)
    got_q, got_k = rotate_queries_and_keys(q, q, cos, cos)
    assert got_q.shape == (0, 4, 8) and got_k.shape == (0, 4, 8)


@pytest.mark.parametrize(
    ("q", "cos", "message"),
    [
        (torch.randn(4, 2, 7), torch.randn(4, 7), "must be even"),
        (torch.randn(4, 2, 8).double(), torch.randn(4, 8), "float16, bfloat16 or float32"),
        (torch.randn(4, 16), torch.randn(4, 16), r"\[tokens, heads, head_dim\]"),
        (torch.randn(4, 2, 8), torch.randn(4, 2, 8), r"cos must be a floating \[tokens"),
        (torch.randn(4, 2, 8), torch.randn(5, 8), r"cos must be a floating \[tokens"),
    ],
)
def test_bad_inputs_are_refused_naming_what_is_wrong(
    q: torch.Tensor, cos: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rotate_queries_and_keys(q, q, cos, cos)
