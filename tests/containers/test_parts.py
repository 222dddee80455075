"""The finite check every container's skip rests on."""

import pytest
import torch

from containers.parts import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_exact_where_a_sum_would_overflow_and_leaves_tensors_bitwise(dtype):
    big = torch.finfo(dtype).max
    tensors = [torch.full((1000,), big, dtype=dtype), torch.tensor([-0.0, 1e-8], dtype=dtype)]
    before = [t.clone() for t in tensors]
    assert all_finite(tensors)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b) and t.signbit().equal(b.signbit())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_element_in_a_mixed_dtype_list_is_found(bad):
    tensors = [torch.ones(3), torch.ones(5, dtype=torch.bfloat16), torch.zeros(0)]
    tensors[1][4] = bad
    assert not all_finite(tensors)
    assert all_finite(tensors[:1] + tensors[2:])


def test_sparse_gradients_are_checked_by_their_values():
    good = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    bad = torch.sparse_coo_tensor([[1]], [float("nan")], (4,), check_invariants=True)
    assert all_finite([good]) and not all_finite([good, bad]) and all_finite([])
