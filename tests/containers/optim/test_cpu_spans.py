"""containers/optim/cpu_spans: the kernel over many tensors in one call, on torch's threads."""

from __future__ import annotations

import ctypes
import random
import re
import shutil

import pytest
import torch

from containers.optim import cpu_adam, cpu_spans

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "eps": 1e-8}


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_shares_cover_every_element_once_in_order_cut_at_whole_lines():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [0, 1, 63, 64, 1000, 4096, 70001]
        numels = tuple(rng.choice(sizes) for _ in range(rng.randint(1, 9)))
        parts = rng.randint(1, 5)
        cut = cpu_spans.shares(numels, parts)
        spans = [span for share in cut for span in share]
        # in order, back to back, every element of every tensor once
        pieces = {i: [(lo, hi) for j, lo, hi in spans if j == i] for i in range(len(numels))}
        for i, n in enumerate(numels):
            ends = [0] + [hi for _, hi in pieces[i]]
            assert [lo for lo, _ in pieces[i]] == ends[:-1] and ends[-1] == n, (numels, parts)
        assert [i for i, _, _ in spans] == sorted(i for i, _, _ in spans)
        # a cut inside a tensor at a multiple of CUT; no more shares than asked
        assert all(lo % cpu_spans.CUT == 0 for _, lo, _ in spans)
        assert len(cut) <= parts
        sizes = [sum(hi - lo for _, lo, hi in share) for share in cut]
        if len(cut) == parts > 1:  # about equal: a share is off by less than a piece
            assert max(sizes) - min(sizes) <= max(numels), (numels, parts, sizes)


def _flat_state(numels: list[int], moment: torch.dtype, mode: str, seed: int = 0):
    """Per-tensor gradients and bf16 parameters; flat buffers with gaps between tensors."""
    gen = torch.Generator().manual_seed(seed)
    starts, at = [], 0
    for n in numels:
        starts.append(at)
        at += n + 64
    grads = [torch.randn(n, generator=gen).bfloat16() for n in numels]
    master = torch.randn(at, generator=gen)
    params = [master[s : s + n].bfloat16() for s, n in zip(starts, numels)]
    m = (torch.randn(at, generator=gen) * 0.1).to(moment)
    v = (torch.rand(at, generator=gen) * 0.1).to(moment)
    kept = {"master": master}
    if mode == "remainder":
        kept = {"remainder": torch.randint(-(2**15), 2**15, (at,), generator=gen).to(torch.int16)}
    return grads, params, starts, kept, m, v


@pytest.mark.parametrize("moment", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["master", "remainder"])
def test_one_call_over_many_tensors_steps_what_a_call_a_tensor_steps(
    lib, two_threads, moment, mode
):
    numels = [5000, 7, 64, 130000, 33, 20000]
    grads, params, starts, kept, m, v = _flat_state(numels, moment, mode)
    hyper = cpu_adam.settings(**HYPER, step=3.0, factor=0.5)
    theirs = [t.clone() for t in (*params, *kept.values(), m, v)]
    key = next(iter(kept))
    for i, (g, s, n) in enumerate(zip(grads, starts, numels)):
        cpu_adam.update(
            lib, hyper, grad=g, param=theirs[i], exp_avg=theirs[-2][s : s + n],
            exp_avg_sq=theirs[-1][s : s + n], **{key: theirs[len(numels)][s : s + n]}, adamw=True,
        )  # fmt: skip
    assert cpu_spans.threads(lib) == 2 and len(cpu_spans.shares(tuple(numels), 2)) == 2
    cpu_spans.update_spans(
        lib, hyper, grads=grads, params=params, starts=starts, exp_avg=m, exp_avg_sq=v,
        **kept, adamw=True,
    )  # fmt: skip
    ours = (*params, *kept.values(), m, v)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # a set flag: nothing written
    before = [t.clone() for t in ours]
    cpu_spans.update_spans(
        lib, hyper, grads=grads, params=params, starts=starts, exp_avg=m, exp_avg_sq=v,
        **kept, adamw=True, found_inf=torch.tensor(1.0),
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(ours, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sum_of_squares_is_the_fp64_one_within_fp32_roundings(lib, two_threads, dtype):
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen).to(dtype) * 10 for n in (1, 255, 256, 70001, 3)]
    exact = sum(float(t.double().square().sum()) for t in tensors)
    ours = cpu_spans.sum_of_squares(lib, tensors)
    assert ours == pytest.approx(exact, rel=1e-6)
    assert cpu_spans.sum_of_squares(lib, tensors) == ours  # the same bits every time
    torch.set_num_threads(1)
    assert cpu_spans.sum_of_squares(lib, tensors) == pytest.approx(exact, rel=1e-6)
    tensors[3][5] = float("nan")
    assert cpu_spans.sum_of_squares(lib, tensors) != cpu_spans.sum_of_squares(lib, tensors)
    tensors[3][5] = 3e19  # finite, its square beyond fp32: inf, as an fp32 norm's
    assert cpu_spans.sum_of_squares(lib, tensors) == float("inf")


MISREAD = {  # what is wrong -> the words the error must say
    "undersized gradient": "grads[1] has 100 elements and its parameter 200",
    "gradient not contiguous": "grads[1] is a torch.bfloat16 tensor on cpu (contiguous: False)",
    "fp32 parameter": "params[0] is a torch.float32 tensor",
    "a span past the buffers": "tensor 2 (3000 elements from 5000) runs past the flat buffers'",
    "fewer starts": "2 grads, 2 params and 1 starts",
    "moments of two sizes": "exp_avg and exp_avg_sq differ in dtype or size",
    "no master": "give master or remainder (a flat buffer)",
    "master and remainder": "give master or remainder, not both",
    "a flag of 2 values": "cpu_spans.update_spans: found_inf is torch.float32 x 2",
}


def _misread(name: str) -> dict:
    grads, params, starts, kept, m, v = _flat_state([100, 200, 3000], torch.float32, "master")
    kw = {"grads": grads, "params": params, "starts": starts, "exp_avg": m, "exp_avg_sq": v}
    kw |= kept
    if name == "undersized gradient":
        grads[1] = grads[1][:100]
    elif name == "gradient not contiguous":
        grads[1] = torch.zeros(200, 2).bfloat16()[:, 0]
    elif name == "fp32 parameter":
        params[0] = params[0].float()
    elif name == "a span past the buffers":
        starts[2] = 5000
    elif name == "fewer starts":
        kw = kw | {"grads": grads[:2], "params": params[:2], "starts": starts[:1]}
    elif name == "moments of two sizes":
        kw["exp_avg_sq"] = v[:-1]
    elif name == "no master":
        del kw["master"]
    elif name == "master and remainder":
        kw["remainder"] = torch.zeros(kw["master"].numel(), dtype=torch.int16)
    elif name == "a flag of 2 values":
        kw["found_inf"] = torch.zeros(2)
    return kw


@pytest.mark.parametrize("name", list(MISREAD))
def test_what_the_kernel_would_misread_raises_before_anything_is_written(lib, name):
    kw = _misread(name)
    tensors = [t for x in kw.values() for t in (x if isinstance(x, list) else [x])]
    before = [t.clone() for t in tensors if isinstance(t, torch.Tensor)]
    hyper = cpu_adam.settings(**HYPER, step=1.0)
    with pytest.raises(ValueError, match=re.escape(MISREAD[name])):
        cpu_spans.update_spans(lib, hyper, **kw, adamw=True)
    after = [t for t in tensors if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_second_openmp_runtime_is_refused_and_the_kernel_runs_on_one_thread(
    lib, two_threads, tmp_path, caplog
):
    """torch's own runtime passes the probe; a copy of it loaded apart (a second runtime, as a
    differently named libgomp would be) starts threads of its own: refused, one thread."""
    with open("/proc/self/maps") as maps:
        found = [line.split()[-1] for line in maps if "gomp" in line.rsplit("/", 1)[-1]]
    if not found:
        pytest.skip("torch here does not run libgomp")
    assert cpu_spans.give_runtime(lib, ctypes.CDLL(None))
    copy = tmp_path / "libgomp-second.so.1"
    shutil.copy(found[0], copy)
    try:
        assert not cpu_spans.give_runtime(lib, ctypes.CDLL(str(copy)))
        assert "not shown to be torch's" in caplog.text
        # still right, on one thread
        grads = _flat_state([5000, 300], torch.float32, "master")[0]
        theirs = sum(float(g.double().square().sum()) for g in grads)
        assert cpu_spans.sum_of_squares(lib, grads) == pytest.approx(theirs, rel=1e-6)
    finally:
        assert cpu_spans.give_runtime(lib, ctypes.CDLL(None))


def test_the_runtime_is_checked_for_each_thread_count_one_thread_needs_none(lib, monkeypatch):
    """A probe of one thread tells no runtime apart: one thread runs without one, and a count
    torch moves to later is probed then."""
    monkeypatch.setattr(cpu_spans, "_teams", {})
    before = torch.get_num_threads()
    tensors = [torch.randn(70001).bfloat16()]
    exact = float(tensors[0].double().square().sum())
    try:
        torch.set_num_threads(1)
        assert cpu_spans.sum_of_squares(lib, tensors) == pytest.approx(exact, rel=1e-6)
        assert cpu_spans._teams == {}
        torch.set_num_threads(2)
        assert cpu_spans.sum_of_squares(lib, tensors) == pytest.approx(exact, rel=1e-6)
        assert cpu_spans._teams == {(id(lib), 2): True}
    finally:
        torch.set_num_threads(before)
