"""containers/optim/cpu_adam: one pass over lean or mixed-precision storage, torch's bits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from config import MixedPrecision as MP
from containers import LeanAdam, LeanAdamW, MixedPrecisionOptimizersContainer
from containers.optim import cpu_adam, cpu_spans
from containers.precision import flat_step, remainders
from tests.harness.helpers import loose_params, same_grads

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "eps": 1e-8}
RULES = {  # torch's kernel, and what it is asked
    "adamw": (torch._fused_adamw_, {}),
    "adam, L2": (torch._fused_adam_, {}),
    "adam, maximize, beta1 0.3": (torch._fused_adam_, {"beta1": 0.3, "weight_decay": 0.0}),
    "adamw, maximize": (torch._fused_adamw_, {"beta2": 0.95}),
}


@pytest.fixture
def calls(lib, monkeypatch):
    """One CPU thread (the containers take the kernel), and the numels it stepped counted:
    a tensor a call (`update`), or a flat group's tensors in one call (`update_spans`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    counted: list[int] = []
    update, spans = cpu_adam.update, cpu_spans.update_spans

    def counting(*args, **kwargs):
        counted.append(kwargs["grad"].numel())
        update(*args, **kwargs)

    def counting_spans(*args, **kwargs):
        counted.extend(g.numel() for g in kwargs["grads"])
        spans(*args, **kwargs)

    monkeypatch.setattr(cpu_adam, "update", counting)
    monkeypatch.setattr(flat_step, "update_spans", counting_spans)
    yield counted
    torch.set_num_threads(threads)


def _values(n: int, grad_dtype: torch.dtype, moment_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 0.1).to(moment_dtype)
    v = (torch.rand(n, generator=gen) * 0.1).to(moment_dtype)
    return master, grad, m, v


def _torch_step(rule: str, master, grad, m, v, step: float, factor: float):
    """Torch's fused kernel on fp32 copies (padded to its vector width: every element on its
    vector loop), the moments rounded back to their dtype: the new (master, m, v)."""
    kernel, over = RULES[rule]
    pad = -len(master) % cpu_adam.VECTOR
    wide = [torch.cat([t.float(), t.new_zeros(pad, dtype=torch.float32)]) for t in (master, m, v)]
    g = torch.cat([grad.float() * factor, grad.new_zeros(pad, dtype=torch.float32)])
    kernel(
        [wide[0]], [g], [wide[1]], [wide[2]], [], [torch.tensor(step)], amsgrad=False,
        maximize="maximize" in rule, **(HYPER | over),
    )  # fmt: skip
    n = len(master)
    return wide[0][:n], wide[1][:n].to(m.dtype), wide[2][:n].to(v.dtype)


def _ours(lib, rule: str, step: float, factor: float, **tensors) -> None:
    _, over = RULES[rule]
    hyper = cpu_adam.settings(**(HYPER | over), step=step, factor=factor)
    adamw, maximize = rule.startswith("adamw"), "maximize" in rule
    cpu_adam.update(lib, hyper, adamw=adamw, maximize=maximize, **tensors)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["master", "master and param", "remainder"])
def test_every_storage_steps_as_torchs_fused_kernel_on_its_widened_values(
    lib, rule, grad_dtype, moment_dtype, mode
):
    n = 16 * 37 + 5  # the last 5: stepped as the vector loop steps, not as torch's tail
    master, grad, m, v = _values(n, grad_dtype, moment_dtype)
    param = master.bfloat16()
    rem = torch.empty(n, dtype=torch.int16)
    if mode == "remainder":
        remainders.store(master, param, rem)
        master = remainders.masters_of(param, rem)  # the master the pair holds
    ref_master, ref_m, ref_v = master.clone(), m.clone(), v.clone()
    for step in (1.0, 2.0, 9.0):
        ref_master, ref_m, ref_v = _torch_step(rule, ref_master, grad, ref_m, ref_v, step, 0.3)
        if mode == "remainder":
            _ours(
                lib, rule, step, 0.3, grad=grad, exp_avg=m, exp_avg_sq=v, param=param, remainder=rem
            )
        else:
            kept = {"param": param} if mode == "master and param" else {}
            _ours(lib, rule, step, 0.3, grad=grad, exp_avg=m, exp_avg_sq=v, master=master, **kept)
    ours = remainders.masters_of(param, rem) if mode == "remainder" else master
    for name, a, b in (
        ("master", ours, ref_master),
        ("exp_avg", m, ref_m),
        ("exp_avg_sq", v, ref_v),
    ):
        assert torch.equal(_bits(a), _bits(b)), name
    if mode != "master":
        # the parameter: the master rounded (to nearest even, or half away from zero with
        # remainders, whose rounding the remainder completes)
        ref_param = torch.empty_like(param)
        remainders.store(ref_master, ref_param, torch.empty_like(rem))
        want = ref_param if mode == "remainder" else ref_master.bfloat16()
        assert torch.equal(_bits(param), _bits(want))


def test_a_set_flag_writes_nothing(lib):
    master, grad, m, v = _values(256, torch.bfloat16, torch.bfloat16)
    param, rem = master.bfloat16(), torch.zeros(256, dtype=torch.int16)
    before = [t.clone() for t in (master, m, v, param, rem)]
    for flag, changed in ((1.0, False), (0.0, True)):
        _ours(
            lib, "adamw", 1.0, 1.0, grad=grad, exp_avg=m, exp_avg_sq=v, master=master,
            param=param, found_inf=torch.tensor(flag),
        )  # fmt: skip
        after = (master, m, v, param, rem)
        assert [torch.equal(a, b) for a, b in zip(after[:4], before)] == [not changed] * 4, flag


def test_the_containers_take_it_where_torch_steps_on_few_threads(lib):
    threads = torch.get_num_threads()
    try:
        for n in (1, cpu_adam.MAX_THREADS):
            torch.set_num_threads(n)
            assert cpu_adam.kernel() is lib
        torch.set_num_threads(cpu_adam.MAX_THREADS + 1)  # not measured beyond: torch's path
        assert cpu_adam.kernel() is None
    finally:
        torch.set_num_threads(threads)
    with cpu_adam.disabled():
        assert cpu_adam.library() is None


SHAPES = [(300, 100), (33,), (3, 5, 7), (64, 48)]  # tails (33, 105), one not contiguous


def _lean_run(cls, found_inf: bool) -> list[torch.Tensor]:
    params = loose_params(SHAPES, 0)
    opt = cls(params, lr=1e-2, weight_decay=0.1, moment_dtype="bfloat16", betas=(0.8, 0.95))
    for step in range(3):
        same_grads(step, params)
        opt.found_inf = torch.tensor(float(found_inf and step == 1))
        opt.step()
    return [t for p in params for t in (p, *opt.state[p].values())]


@pytest.mark.parametrize("cls", [LeanAdamW, LeanAdam])
def test_lean_adam_steps_the_same_bits_in_one_pass_as_through_fp32_scratch(calls, cls):
    for found_inf in (False, True):
        ours = _lean_run(cls, found_inf)
        # each contiguous tensor's vector loop (33 -> 32, 105 -> 96), not the one of (64, 48)
        # that is not contiguous (it steps whole, widened)
        assert sorted(set(calls)) == [32, 96, 30000]
        calls.clear()
        with cpu_adam.disabled():
            theirs = _lean_run(cls, found_inf)
        assert not calls
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _mp_run(cls, kw: dict, shapes) -> dict:
    torch.manual_seed(0)
    model = nn.Module()
    for i, s in enumerate(shapes):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(s).bfloat16()))
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "fused": True} | kw
    settings = MP(loss_scaling="none", store_param_remainders="moment_dtype" in kw)
    mp = MixedPrecisionOptimizersContainer([model], cls, kwargs, settings=settings)
    for step in range(3):
        torch.manual_seed(100 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape).bfloat16()
        mp.precision._unscale = 0.3  # as a loss scale of 1 / 0.3 would
        mp.precision.apply(mp.optimizers)
    return mp.state_dict() | {f"param.{n}": p for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(torch.optim.AdamW, {}), (torch.optim.Adam, {}), (LeanAdamW, {"moment_dtype": "bfloat16"})],
    ids=["fp32 masters", "adam, fp32 masters", "remainders and bf16 moments"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_mixed_precision_steps_the_same_bits_in_one_pass_as_through_fp32_scratch(
    calls, cls, kw, threads
):
    shapes = [(5, 3), (7,), (4, 67), (2, 2, 64), (300, 33)]  # on 2 threads: one cut in the last
    torch.set_num_threads(threads)
    ours = _mp_run(cls, kw, shapes)
    assert sorted(set(calls)) == [7, 15, 256, 268, 9900]  # every tensor, tails and all
    with cpu_adam.disabled():
        theirs = _mp_run(cls, kw, shapes)
    assert ours.keys() == theirs.keys()
    for key in ours:
        a, b = ours[key], theirs[key]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key


def _misread(name: str, n: int = 64) -> dict:
    """update()'s arguments with `name` made into what the C code would misread."""
    master, grad, m, v = _values(n, torch.bfloat16, torch.float32)
    kw = {"grad": grad, "exp_avg": m, "exp_avg_sq": v, "master": master}
    if name == "undersized gradient":
        kw["grad"] = grad[: n - 8]
    elif name == "fp16 gradient":
        kw["grad"] = grad.half()
    elif name == "moments of two dtypes":
        kw["exp_avg_sq"] = v.bfloat16()
    elif name == "moment not contiguous":
        kw["exp_avg"] = torch.zeros(n, 2)[:, 0]
    elif name == "no master":
        del kw["master"]
    elif name == "master and remainder":
        kw |= {"param": master.bfloat16(), "remainder": torch.zeros(n, dtype=torch.int16)}
    elif name == "fp16 parameter":
        kw["param"] = master.half()
    elif name == "a flag of 2 values":
        kw["found_inf"] = torch.zeros(2)
    return kw


MISREAD = {  # what is wrong -> the words the error must say
    "undersized gradient": "master has 64 elements and grad 56",
    "fp16 gradient": "grad is a torch.float16",
    "moments of two dtypes": "exp_avg_sq is a torch.bfloat16 tensor and exp_avg a torch.float32",
    "moment not contiguous": "contiguous: False",
    "no master": "master is missing",
    "master and remainder": "master is extra",
    "fp16 parameter": "param is a torch.float16",
    "a flag of 2 values": "found_inf is torch.float32 x 2",
}


@pytest.mark.parametrize("name", list(MISREAD))
def test_what_the_kernel_would_misread_raises_before_anything_is_written(lib, name):
    kw = _misread(name)
    before = {k: t.clone() for k, t in kw.items()}
    with pytest.raises(ValueError, match=re.escape(MISREAD[name])):
        _ours(lib, "adamw", 1.0, 1.0, **kw)
    assert all(torch.equal(kw[k], t) for k, t in before.items())


def _variant(tmp_path, old: str = "", new: str = "") -> Path:
    """A copy of the kernel's source (with `old` made `new`): a library of its own name."""
    text = cpu_adam.SOURCE.read_text()
    assert old in text
    source = tmp_path / "variant.c"
    source.write_text(text.replace(old, new) + "/* a variant for a test */\n")
    return source


@pytest.fixture
def cache(tmp_path, monkeypatch, lib):
    """A private cache directory of the test's own."""
    path = tmp_path / "cache"
    monkeypatch.setenv("OPTIMIZER_CONTAINERS_CACHE", str(path))
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_missing_compiler_falls_back_with_one_line(tmp_path, cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_adam.load(cpu_adam.SOURCE) is None
    (line,) = _warnings(caplog)
    assert "cpu_adam: not used" in line and "no-such-cc" in line and "torch's slower path" in line
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("int oc_adam_abi(void) { return 3; }", "int oc_adam_abi(void) { return 4; }", "layout 4"),
        # the second moment without the multiply-add torch's build forms: other roundings
        ("v = fmaf(c2 * g, g, v * b2);", "v = v * b2 + c2 * g * g;", "disagrees"),
    ],
    ids=["another argument layout", "another rounding"],
)
def test_a_library_that_does_not_match_is_not_used(tmp_path, cache, caplog, old, new, said):
    assert cpu_adam.load(_variant(tmp_path, old, new)) is None
    (line,) = _warnings(caplog)
    assert said in line and "torch's slower path" in line


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("scales one short", "exp_avg_sq scale has 15 elements, expected 16 (one a block of 32"),
        ("codes of another dtype", "exp_avg_sq code is a torch.int8 tensor"),
        ("master not contiguous", "master is a torch.float32 tensor on cpu (contiguous: False)"),
    ],
)
def test_what_the_8bit_kernel_would_misread_raises_before_anything_is_written(name, said):
    lib = cpu_adam.library()
    if lib is None:
        pytest.skip("no C compiler here: the kernel is not used")
    master, grad = torch.randn(8, 64), torch.randn(8, 64)
    m = (torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2))
    v = (torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2))
    if name == "scales one short":
        v = (v[0], v[1].view(-1)[:15])
    elif name == "codes of another dtype":
        v = (v[0].view(torch.int8), v[1])
    else:
        master = torch.randn(64, 8).t()
    before = [t.clone() for t in (master, *m, *v)]
    h = cpu_adam.settings(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, step=1)
    with pytest.raises(ValueError, match=re.escape(said)):
        cpu_adam.update_coded(lib, h, master=master, grad=grad, exp_avg=m, exp_avg_sq=v,
                              adamw=True)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip((master, *m, *v), before))
