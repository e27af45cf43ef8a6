"""The fused ``silu(gate) * up`` kernel against the eager composition.

Without a GPU the kernel runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set
below before Triton is imported); with one, the same tests run the compiled kernel on CUDA.

The reference is computed in float32 from the same (rounded) inputs, rounded once to the
dtype. Tolerances, element by element, ``|got - want| <= atol + rtol * |want|``: ``rtol``
twice the dtype's machine epsilon (Triton's interpreter rounds toward zero where the GPU
rounds to nearest; ``sigmoid`` is computed another way), ``atol`` 1e-5. Against eager's own
composition (the SiLU rounded first) the tolerance is the dtype's default.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layergraph.kernels.gated import silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 1024, 1280, 3456])
def test_halves_of_one_product_equal_the_float32_composition(
    dtype: torch.dtype, width: int
) -> None:
    product = (torch.randn(9, 2 * width, device=DEVICE) * 3).to(dtype)
    gate, up = product.split(width, dim=-1)
    got = silu_and_mul(gate, up)
    want = (F.silu(gate.float()) * up.float()).to(dtype)
    assert got.is_contiguous() and got.dtype == dtype and got.shape == (9, width)
    torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    torch.testing.assert_close(got, F.silu(gate) * up)


def test_no_rows_give_an_empty_result() -> None:
    empty = torch.randn(0, 8, device=DEVICE)
    assert silu_and_mul(empty, empty).shape == (0, 8)


@pytest.mark.parametrize(
    ("gate", "up", "message"),
    [
        (torch.randn(4, 8), torch.randn(4, 9), r"both be \[rows, width\]"),
        (torch.randn(2, 4, 8), torch.randn(2, 4, 8), r"both be \[rows, width\]"),
        (torch.randn(4, 8), torch.randn(4, 8).half(), "one dtype"),
        (torch.randn(4, 8).double(), torch.randn(4, 8).double(), "float16, bfloat16 or float32"),
    ],
)
def test_bad_inputs_are_refused_naming_what_is_wrong(
    gate: torch.Tensor, up: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        silu_and_mul(gate, up)
