"""Call signatures, shape keys and batch buckets."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from layergraph.keys import BatchBuckets, CallInputs, UnsupportedCall


def test_call_inputs_split_tensors_from_fixed_arguments() -> None:
    x, mask = torch.randn(3, 5, 7), torch.ones(3, 5)
    call = CallInputs((x, 2), {"mask": mask, "flag": True})
    assert call.batch == 3
    assert call.tensors == (x, mask)
    new = (torch.zeros(3, 5, 7), torch.zeros(3, 5))
    args, kwargs = call.rebuild(new)
    assert args[0] is new[0] and args[1] == 2
    assert kwargs["mask"] is new[1] and kwargs["flag"] is True


def test_signature_ignores_batch_but_not_shape_dtype_or_values() -> None:
    def signature(*args: object, **kwargs: object) -> object:
        return CallInputs(args, kwargs).signature

    base = signature(torch.randn(2, 4))
    assert signature(torch.randn(9, 4)) == base
    assert signature(torch.randn(2, 5)) != base
    assert signature(torch.randn(2, 4, dtype=torch.float64)) != base
    assert signature(torch.randn(2, 4), 1) != signature(torch.randn(2, 4), 2)
    assert signature(x=torch.randn(2, 4)) != base
    assert signature(torch.randn(2, 4), [1, 2]) == signature(torch.randn(3, 4), [1, 2])
    assert signature(torch.randn(2, 4), [1, 2]) != signature(torch.randn(2, 4), (1, 2))
    assert signature(torch.randn(2, 4), {"a": [1]}) != signature(torch.randn(2, 4), {"a": [2]})


def test_argument_reads_keyword_tensors_and_fixed_values() -> None:
    x, mask, sizes = torch.randn(3, 5), torch.ones(3, 5), [2, 3]
    call = CallInputs((x, 2), {"mask": mask, "flag": False, "sizes": sizes})
    assert call.argument("mask") is mask
    assert call.argument("flag") is False
    assert call.argument("sizes") is sizes
    assert call.argument("missing") is None
    assert call.argument("missing", default=7) == 7


def test_argument_with_a_position_finds_it_passed_either_way() -> None:
    x = torch.randn(2, 3, 8, 8)
    by_position = CallInputs((x, True), {})
    by_keyword = CallInputs((), {"pixel_values": x, "interpolate": True})
    assert by_position.argument("pixel_values", position=0) is x
    assert by_keyword.argument("pixel_values", position=0) is x
    assert by_position.argument("interpolate", position=1) is True
    assert by_position.argument("pixel_values") is None
    assert by_position.argument("mask", position=2, default="none") == "none"


def test_argument_reads_the_sliced_calls_own_rows() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5.0).reshape(5, 1)
    part = CallInputs((x,), {"y": y, "scale": 2}).sliced(1, 3)
    assert torch.equal(part.argument("x", position=0), x[1:3])
    assert torch.equal(part.argument("y"), y[1:3])
    assert part.argument("scale") == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.randn(2, 3), torch.randn(3, 3)), "disagree on the batch size"),
        ((torch.tensor(1.0),), "no batch dimension"),
        (([torch.randn(2, 3)],), "nested"),
        ((1, "a"), "no tensor argument"),
        ((torch.randn(2, 3), {"a": {1, 2}}), "set is not hashable"),
    ],
)
def test_unsupported_calls_name_the_problem(args: tuple, message: str) -> None:
    with pytest.raises(UnsupportedCall, match=message):
        CallInputs(args, {})


def test_sliced_call_keeps_fixed_arguments() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    part = CallInputs((x, 3), {}).sliced(1, 4)
    args, _ = part.rebuild(part.tensors)
    assert torch.equal(args[0], x[1:4]) and args[1] == 3


def test_buckets_reject_bad_sizes() -> None:
    for bad in ([], [0, 1], [2, -1], [1.5], [True]):
        with pytest.raises(ValueError, match="batch_sizes"):
            BatchBuckets(bad)


sizes_strategy = st.lists(st.integers(1, 64), min_size=1, max_size=8)


@given(sizes=sizes_strategy, batch=st.integers(1, 200))
def test_bucket_is_smallest_size_that_fits(sizes: list[int], batch: int) -> None:
    buckets = BatchBuckets(sizes)
    bucket = buckets.bucket_for(batch)
    if batch > max(sizes):
        assert bucket is None
    else:
        assert bucket in sizes and bucket >= batch
        assert all(s < batch or s >= bucket for s in sizes)


@given(sizes=sizes_strategy, batch=st.integers(1, 500))
def test_chunks_cover_the_batch_in_order_with_largest_pieces(sizes: list[int], batch: int) -> None:
    chunks = BatchBuckets(sizes).chunks(batch)
    assert chunks[0][0] == 0 and chunks[-1][1] == batch
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert all(stop - start == max(sizes) for start, stop in chunks[:-1])
    assert 0 < chunks[-1][1] - chunks[-1][0] <= max(sizes)


@given(batch=st.integers(1, 1000))
def test_exact_mode_gives_every_batch_its_own_bucket(batch: int) -> None:
    assert BatchBuckets(None).bucket_for(batch) == batch
