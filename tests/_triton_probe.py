"""A Triton kernel that checks the interpreter can run the project's kernels (conftest.py)."""

import triton
import triton.language as tl


@triton.jit
def count_to_loaded_bound(bound_ptr, counted_ptr):
    """Counts from 0 up to the int32 at ``bound_ptr``, in a loop whose bound is loaded."""
    counted = 0
    for _ in range(0, tl.load(bound_ptr)):
        counted += 1
    tl.store(counted_ptr, counted)
