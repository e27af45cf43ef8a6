"""The fused residual-add-and-norm kernel against float32 references of the eager composition.

Without a GPU the kernel runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set
below before Triton is imported); with one, the same tests run the compiled kernel on CUDA.

References, computed in float32 from the same (rounded) inputs: ``residual + scale * h``, and
``F.layer_norm`` or ``F.rms_norm`` of the sum as the kernel stored it (what the eager
composition normalises too; Triton's interpreter rounds float32 to bfloat16 toward zero where
the GPU rounds to nearest, so the stored sum is the one to normalise), times ``weight`` plus
``bias``. Tolerances, element by element, ``|got - want| <= atol + rtol * |want|``: ``rtol`` is
the dtype's machine epsilon (the kernel rounds each output once, by less than one unit in the
last place; float32 gets 1e-5 for sums taken in another order), ``atol`` 1e-5 (values near
zero, where the sums' order shows).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layergraph.kernels.add_norm import MAX_WIDTH, add_norm, add_scaled, norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WIDTHS = (1, 7, 64, 768, 1024, 1152, 1280, 3200)
"""A ViT's widths (vit_base, InternViT-300M, SigLIP so400m, ViT-H, InternViT-6B), and narrow
ones; all but a few are not powers of two."""


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": max(torch.finfo(dtype).eps, 1e-5), "atol": 1e-5}


def summed(residual: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``residual + scale * h`` in float32."""
    return residual.float() + (h.float() if scale is None else h.float() * scale.float())


def normalised(
    stored: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kind: str,
) -> torch.Tensor:
    """The norm of ``stored`` in float32, times ``weight`` plus ``bias``."""
    width = (stored.shape[-1],)
    if kind == "layer_norm":
        normed = F.layer_norm(stored.float(), width, eps=eps)
    else:
        normed = F.rms_norm(stored.float(), width, eps=eps)
    if weight is not None:
        normed = normed * weight.float()
    if bias is not None:
        normed = normed + bias.float()
    return normed


def vector(present: bool, width: int, dtype: torch.dtype, offset: float) -> torch.Tensor | None:
    if not present:
        return None
    return (offset + torch.randn(width, dtype=torch.float32)).to(DEVICE, dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    width=st.sampled_from(WIDTHS),
    rows=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    kind=st.sampled_from(["layer_norm", "rms_norm"]),
    has=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    vector_dtype=st.sampled_from([None, torch.float32]),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_add_norm_equals_the_eager_composition(
    dtype: torch.dtype,
    width: int,
    rows: list[int],
    kind: str,
    has: tuple[bool, bool, bool],
    vector_dtype: torch.dtype | None,
    eps: float,
    seed: int,
) -> None:
    """Any leading shape, width, dtype, norm, and scale, weight and bias each present or not,
    in the inputs' dtype or in float32 (weights kept in float32)."""
    torch.manual_seed(seed)
    residual = (3 * torch.randn(*rows, width)).to(DEVICE, dtype)
    h = torch.randn(*rows, width).to(DEVICE, dtype)
    scale, weight, bias = (
        vector(present, width, vector_dtype or dtype, offset)
        for present, offset in zip(has, (0.0, 1.0, 0.0))
    )
    residual_out, normed = add_norm(residual, h, scale, weight, bias, eps, kind)
    assert residual_out.shape == normed.shape == residual.shape
    assert residual_out.dtype == normed.dtype == dtype
    torch.testing.assert_close(residual_out.float(), summed(residual, h, scale), **tolerance(dtype))
    want = normalised(residual_out, weight, bias, eps, kind)
    torch.testing.assert_close(normed.float(), want, **tolerance(dtype))


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    width=st.sampled_from(WIDTHS),
    rows=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    kind=st.sampled_from(["layer_norm", "rms_norm"]),
    has=st.tuples(st.booleans(), st.booleans()),
    seed=st.integers(0, 2**16),
)
def test_norm_alone_equals_the_reference(
    dtype: torch.dtype,
    width: int,
    rows: list[int],
    kind: str,
    has: tuple[bool, bool],
    seed: int,
) -> None:
    """The norm-only path: any leading shape, width, dtype and norm, weight and bias each
    present or not (weights in float32, as transformers' RMSNorms keep them under autocast)."""
    torch.manual_seed(seed)
    x = (2 + 3 * torch.randn(*rows, width)).to(DEVICE, dtype)
    weight, bias = (vector(p, width, torch.float32, o) for p, o in zip(has, (1.0, 0.0)))
    normed = norm(x, weight, bias, 1e-6, kind)
    assert normed.shape == x.shape and normed.dtype == dtype
    want = normalised(x, weight, bias, 1e-6, kind)
    torch.testing.assert_close(normed.float(), want, **tolerance(dtype))
    assert norm(
        torch.empty(0, width, device=DEVICE, dtype=dtype), weight, None, 1e-6, kind
    ).shape == (
        0,
        width,
    )


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_a_wrong_norm_is_caught(kind: str) -> None:
    """The references tell the two norms apart, so the test above can fail."""
    residual, h = torch.randn(4, 1024, device=DEVICE), torch.randn(4, 1024, device=DEVICE)
    other = "rms_norm" if kind == "layer_norm" else "layer_norm"
    residual_out, normed = add_norm(residual, h + 1, None, None, None, 1e-6, kind)
    torch.testing.assert_close(normed, normalised(residual_out, None, None, 1e-6, kind))
    want = normalised(residual_out, None, None, 1e-6, other)
    assert not torch.allclose(normed, want, **tolerance(torch.float32))


def test_strided_inputs_and_no_rows() -> None:
    residual = torch.randn(1152, 6, device=DEVICE).t()  # rows 1152 elements apart
    h = torch.randn(6, 2 * 1152, device=DEVICE)[:, ::2]
    scale = torch.randn(2 * 1152, device=DEVICE)[::2]
    residual_out, normed = add_norm(residual, h, scale, None, None, 1e-6, "layer_norm")
    want = normalised(summed(residual, h, scale), None, None, 1e-6, "layer_norm")
    torch.testing.assert_close(residual_out, summed(residual, h, scale), **tolerance(torch.float32))
    torch.testing.assert_close(normed, want, **tolerance(torch.float32))
    empty = torch.empty(0, 3, 64, device=DEVICE)
    residual_out, normed = add_norm(empty, empty, None, None, None, 1e-6, "rms_norm")
    assert residual_out.shape == normed.shape == (0, 3, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_scaled_is_the_scaled_residual_add(dtype: torch.dtype) -> None:
    residual = torch.randn(3, 5, 1280).to(DEVICE, dtype)
    h = torch.randn(3, 5, 1280).to(DEVICE, dtype)
    scale = torch.rand(1280).to(DEVICE, dtype)
    want = residual.float() + scale.float() * h.float()
    torch.testing.assert_close(add_scaled(residual, h, scale).float(), want, **tolerance(dtype))
    torch.testing.assert_close(
        add_scaled(residual, h, None).float(), residual.float() + h.float(), **tolerance(dtype)
    )


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(2, 64, device=DEVICE)
    cases = [
        ((x, x[:, :32], None, None, None, 1e-6, "layer_norm"), "one shape and dtype"),
        ((x, x.double(), None, None, None, 1e-6, "layer_norm"), "one shape and dtype"),
        ((x.double(), x.double(), None, None, None, 1e-6, "layer_norm"), "float16, bfloat16"),
        ((x, x, torch.ones(32, device=DEVICE), None, None, 1e-6, "rms_norm"), "vectors of 64"),
        ((x, x, None, None, None, 1e-6, "group_norm"), "kind='group_norm'"),
    ]
    wide = torch.zeros(1, MAX_WIDTH + 1, device=DEVICE)
    cases.append(((wide, wide, None, None, None, 1e-6, "rms_norm"), "1 to 8192 channels"))
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            add_norm(*arguments)


def test_the_operator_passes_pytorchs_checks() -> None:
    """Schema, fake (meta) implementation and dispatch of ``torch.ops.layergraph.add_norm``,
    which ``torch.compile`` relies on to keep the launch as one call."""
    x, h = torch.randn(2, 3, 96, device=DEVICE), torch.randn(2, 3, 96, device=DEVICE)
    weight, bias = torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    torch.library.opcheck(
        torch.ops.layergraph.add_norm.default,
        (x, h, None, weight, bias, 1e-6, False),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.layergraph.norm.default,
        (x, weight, None, 1e-6, True),
        test_utils=("test_schema", "test_faketensor"),
    )
