"""`moment_dtype = "8bit"` and `"4bit"`: Adam's moments in block codes, torch's fused kernel
on the decoded values, converted on load either way (containers stepping them, resumes and
resharding: `test_lean_adam`, with bf16 moments; the 4-bit codes' meaning: `test_codes4`)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import containers.update.driver as driver
from containers import LeanAdam, LeanAdamW, OptimizersContainer
from containers.update import codes8 as moment_codes
from containers.update.forms import MOMENT_CODECS, to_values
from tests.harness.helpers import (
    assert_same,
    loose_params,
    optimizer_state,
    same_grads,
    three_parts,
    train,
)

# Rows over several runs of the scratch, 1-D (bf16 moments), 3-D, one not contiguous.
SHAPES = [(300, 100), (33,), (3, 5, 70), (64, 48)]
KINDS = ["8bit", "4bit"]


def _kw(kind: str) -> dict:
    return {"lr": 1e-2, "fused": True, "moment_dtype": kind}


def _held(name: str, values: torch.Tensor, kind: str = "8bit") -> torch.Tensor:
    """What a coded group holds of a moment: its code decoded (1-D: rounded to bf16); the
    8-bit codes through the functions that define them, not the codec."""
    if values.dim() < 2:
        return values.bfloat16().float()
    if kind != "8bit":
        codec = MOMENT_CODECS[kind]
        return codec.to_values(name, codec.from_values(name, values, values))
    signed = name == "exp_avg"
    code = torch.empty_like(values, dtype=torch.int8 if signed else torch.uint8)
    scale = torch.empty(moment_codes.scale_shape(values.shape))
    out = torch.empty_like(values)
    if signed:
        moment_codes.encode_signed(values, code, scale)
        moment_codes.decode_signed(code, scale, out)
    else:
        moment_codes.encode_log(values, code, scale)
        moment_codes.decode_log(code, scale, out)
    return out


def _value(state: dict, name: str) -> torch.Tensor:
    return to_values(name, state[name]).float()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (LeanAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (LeanAdam, {"lr": 1e-2, "weight_decay": 0.1, "maximize": True, "betas": (0.8, 0.99)}),
    ],
)
def test_a_coded_step_is_torchs_fused_step_on_the_decoded_moments_coded_again(
    cls, kwargs, kind, monkeypatch
):
    """Decode a run of rows into scratch, torch's kernel, encode: torch's bits."""
    monkeypatch.setattr(driver, "scratch_numel", lambda _: 1 << 13)  # 40 rows a run
    coded_params, ref_params = loose_params(SHAPES), loose_params(SHAPES)
    opt = cls(coded_params, moment_dtype=kind, **kwargs)
    torch_cls = torch.optim.AdamW if cls is LeanAdamW else torch.optim.Adam
    ref = torch_cls(ref_params, fused=True, **kwargs)
    for step in range(4):
        same_grads(step, coded_params, ref_params)
        opt.step()
        ref.step()
        for a, b in zip(coded_params, ref_params):
            assert torch.equal(a, b), (step, tuple(a.shape))
            for name in ("exp_avg", "exp_avg_sq"):
                held = _held(name, ref.state[b][name], kind)
                assert torch.equal(_value(opt.state[a], name), held), (step, name)
                ref.state[b][name].copy_(held)  # the reference goes on from the held values
            assert torch.equal(opt.state[a]["step"], ref.state[b]["step"])
    kept, codec = opt.state[coded_params[0]], MOMENT_CODECS[kind]
    assert kept["exp_avg"][codec.CODE].dtype == codec.code_dtype("exp_avg")
    assert kept["exp_avg_sq"][codec.CODE].dtype == torch.uint8
    assert opt.state[coded_params[1]]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize(("kind", "per_param"), [("8bit", 2.25), ("4bit", 1.25)])
def test_coded_moments_take_their_bytes_a_parameter_and_a_flagged_step_changes_nothing(
    kind, per_param
):
    params = loose_params([(40, 4), (64, 128), (96, 64)])
    opt = LeanAdamW(params, **_kw(kind))
    same_grads(0, params)
    opt.step()
    tensors = [t for p in params[1:] for m in opt.state[p].values() if isinstance(m, dict)
               for t in m.values()]  # fmt: skip
    numel = sum(p.numel() for p in params[1:])
    assert sum(t.numel() * t.element_size() for t in tensors) == per_param * numel
    assert 2 * MOMENT_CODECS[kind].bytes_per_value == per_param
    # rows of 4: a scale a block of 4 would cost 4 bytes an element, as much as bf16
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16

    before = [p.detach().clone() for p in params], optimizer_state(opt)
    same_grads(1, params)
    opt.found_inf = torch.ones(())  # as a GradScaler (or the container's check) sets it
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
    assert_same(optimizer_state(opt), before[1])


@pytest.mark.parametrize("kind", KINDS)
def test_an_optimizers_state_converts_between_codes_and_float_moments_both_ways(kind):
    plain_params, coded_params = loose_params(SHAPES), loose_params(SHAPES)
    plain = torch.optim.AdamW(plain_params, lr=1e-2, fused=True)
    coded = LeanAdamW(coded_params, **_kw(kind))
    for step in range(2):
        same_grads(step, plain_params, coded_params)
        plain.step()
        coded.step()

    into_coded = LeanAdamW(loose_params(SHAPES), **_kw(kind))
    into_coded.load_state_dict(plain.state_dict())  # fp32 -> codes
    into_bf16 = LeanAdamW(loose_params(SHAPES), lr=1e-2, moment_dtype="bfloat16")
    into_bf16.load_state_dict(coded.state_dict())  # codes -> bf16
    pairs = zip(plain_params, coded_params, into_coded.param_groups[0]["params"],
                into_bf16.param_groups[0]["params"])  # fmt: skip
    for p, c, to_coded, to_bf16 in pairs:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_value(into_coded.state[to_coded], name),
                               _held(name, plain.state[p][name], kind))  # fmt: skip
            assert into_bf16.state[to_bf16][name].dtype == torch.bfloat16
            assert torch.equal(into_bf16.state[to_bf16][name],
                               _value(coded.state[c], name).bfloat16())  # fmt: skip
    assert into_coded.param_groups[0]["moment_dtype"] == kind  # the run's own storage


@pytest.mark.parametrize("kind", KINDS)
def test_a_containers_state_converts_between_codes_and_float_moments_in_one_log_line(kind, caplog):
    def run(cls: type, **kw) -> tuple[list, OptimizersContainer]:
        parts = three_parts(0)
        return parts, OptimizersContainer(parts, cls, {"lr": 1e-2, "fused": True, **kw})

    coded_parts, coded = run(LeanAdamW, moment_dtype=kind)
    plain_parts, plain = run(torch.optim.AdamW)
    train(coded_parts, coded, 3)
    train(plain_parts, plain, 3)
    from_codes, from_plain = coded.state_dict(), plain.state_dict()

    caplog.set_level("INFO", logger="containers.state.container_state")
    _, into_plain = run(torch.optim.AdamW)  # torch's own class: the container decodes
    into_plain.load_state_dict(from_codes)
    _, into_codes = run(LeanAdamW, moment_dtype=kind)
    into_codes.load_state_dict(from_plain)
    said = [r.getMessage() for r in caplog.records]
    codec = MOMENT_CODECS[kind]
    # 4-bit codes take rows of whole bytes: (7, 10) is coded, (9, 7) and (5, 9) keep bf16
    n = 2 * sum(codec.keeps(p) for part in coded_parts for p in part.parameters())
    assert n == (6 if kind == "8bit" else 2)
    assert said == [
        f"optimizer state converted on load: exp_avg, exp_avg_sq {codec.label} -> tensor "
        f"({n} tensors)",
        f"optimizer state converted on load: exp_avg, exp_avg_sq tensor -> {codec.label} "
        f"({n} tensors)",
    ]
    got_plain, got_codes = into_plain.state_dict(), into_codes.state_dict()
    for key, value in from_plain.items():
        name = key.rsplit(".", 1)[-1]
        if name not in ("exp_avg", "exp_avg_sq") or not codec.keeps(value):
            continue
        codes = {k: from_codes[f"{key}.{k}"] for k in (codec.CODE, "scale")}
        assert torch.equal(got_plain[key], to_values(name, codes))
        want = codec.from_values(name, value, value)
        assert all(torch.equal(got_codes[f"{key}.{k}"], want[k]) for k in want), key
    caplog.clear()
    into_codes.load_state_dict(got_codes)  # its own form: nothing converted, nothing said
    assert not caplog.records


@pytest.mark.parametrize(
    ("shape", "mesh", "placements", "column"),
    [
        ((4, 40), (2,), (Shard(1),), 20),  # 20 columns a shard: inside the first block
        ((4, 100), (3,), (Shard(1),), 34),
        ((4, 128), (2,), (Shard(1),), None),  # 64 a shard: whole blocks
        ((4, 96), (3,), (Shard(1),), None),
        ((5, 40), (2,), (Shard(0),), None),  # rows cut, never a block
        ((8, 64), (2, 2), (Shard(0), Shard(1)), None),
        ((8, 64), (2, 4), (Shard(0), Shard(1)), 16),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_where_shards_cut_rows_inside_blocks(shape, mesh, placements, column, kind):
    """Every rank's piece is checked, not this rank's: the first shard of (4, 40) is whole;
    4-bit codes (two a byte) are cut where their elements are."""
    assert MOMENT_CODECS[kind]._cut_inside(shape, mesh, placements) == column


@pytest.mark.parametrize("kind", KINDS)
def test_amsgrad_with_coded_moments_is_refused_before_any_state(kind):
    params = loose_params([(4, 40)])
    with pytest.raises(ValueError, match=rf"moment_dtype = '{kind}' with amsgrad = True"):
        LeanAdamW(params, amsgrad=True, **_kw(kind))
