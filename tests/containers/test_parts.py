"""The finite checks every container's skip rests on."""

import pytest
import torch
import torch.distributed as dist

from containers.parts import all_finite, nonfinite_flag
from tests.harness.dist import run_ranks


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


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device_kernel"])
def test_the_flag_for_fused_kernels_finds_what_all_finite_finds_and_leaves_tensors_bitwise(
    on_host,
):
    """`nonfinite_flag` as a step takes it on CUDA (`on_host=False`: torch's AMP check, run
    here on CPU tensors) and elsewhere: the same answers, values and signs kept."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for bad, want in ((float("nan"), 1.0), (float("inf"), 1.0), (float("-inf"), 1.0)):
        for where, dtype in enumerate(dtypes):
            tensors = [torch.randn(300, dtype=d) for d in dtypes] + [torch.zeros(0)]
            tensors[where][7 * where] = bad
            assert nonfinite_flag(tensors, [], on_host=on_host).item() == want, (bad, dtype)
    big = [torch.full((1000,), torch.finfo(d).max, dtype=d) for d in dtypes]
    big.append(torch.tensor([-0.0, 1e-8]))
    before = [t.clone() for t in big]
    flag = nonfinite_flag(big, [], on_host=on_host)
    assert flag.item() == 0.0 and flag.dtype == torch.float32 and flag.dim() == 0
    for t, b in zip(big, before):
        assert torch.equal(t, b) and t.signbit().equal(b.signbit())


def _flag_on_ranks(on_host: bool) -> float:
    grads = [torch.randn(64), torch.randn(32)]
    if dist.get_rank() == 1:
        grads[1][3] = float("nan")
    return nonfinite_flag(grads, [None], on_host=on_host).item()


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device_kernel"])
def test_the_flag_is_the_worlds(on_host):
    assert run_ranks(2, _flag_on_ranks, on_host) == [1.0, 1.0]
