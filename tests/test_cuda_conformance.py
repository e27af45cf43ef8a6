"""The conformance suite (:mod:`test_conformance`) on CUDA graphs: every class of the coverage
page, the same drawn calls, options, refills and reads, against the unwrapped twin on the GPU.

Float32 (TF32 off), 1e-3 relative error: a padded batch runs other cuBLAS kernels than the
twin's batch, and a field computed on demand runs the adapter's attention, which differ from
the twin's in float32 by up to about 3e-4. A case where this and the CPU's simulated replay
disagree otherwise is a bug of the simulator.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from coverage_table import PACKED_SERVED, SERVED
from test_conformance import EXAMPLES, check_packed_class, check_served_class

pytestmark = pytest.mark.cuda

CUDA_TOLERANCE = 1e-3


@pytest.mark.parametrize("name", sorted(n for n in SERVED if SERVED[n].available()))
@EXAMPLES
@given(data=st.data())
def test_a_served_class_answers_as_eager_on_cuda_graphs(name: str, data: st.DataObject) -> None:
    check_served_class(name, data, device="cuda", tolerance=CUDA_TOLERANCE)


@pytest.mark.parametrize("name", sorted(PACKED_SERVED))
@EXAMPLES
@given(data=st.data())
def test_a_packed_class_answers_as_eager_on_cuda_graphs(name: str, data: st.DataObject) -> None:
    check_packed_class(name, data, device="cuda", tolerance=CUDA_TOLERANCE)
