"""The 8-bit moment codes: what they hold, that blocks move whole with rows, bad input."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from containers.update import codes8 as mc

SHAPES = [(6, 96), (5, 70), (100,), (), (3, 4, 33), (0, 32), (4, 0)]


def _wide(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values whose magnitudes span 8 decades, within blocks too."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 10 ** (-8 * torch.rand(shape, generator=g))


def _coded(
    x: torch.Tensor, encode: Callable, decode: Callable, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The codes, the scales and the values a code holds of `x`."""
    code = torch.empty(x.shape, dtype=dtype)
    scale = torch.empty(mc.scale_shape(x.shape))
    encode(x, code, scale)
    out = torch.empty(x.shape)
    decode(code, scale, out)
    return code, scale, out


def _signed(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _coded(x, mc.encode_signed, mc.decode_signed, torch.int8)


def _log(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _coded(x, mc.encode_log, mc.decode_log, torch.uint8)


def _by_block(x: torch.Tensor) -> torch.Tensor:
    """(rows, blocks, 32), zero-padded: the layout the codes use."""
    last = x.shape[-1] if x.dim() else 1
    r = x.reshape(-1, last)
    r = torch.nn.functional.pad(r, (0, -last % mc.BLOCK))
    return r.view(r.shape[0], -1, mc.BLOCK)


@pytest.mark.parametrize("shape", SHAPES)
def test_what_a_code_holds_encodes_to_the_same_codes_and_scales(shape):
    x = _wide(shape)
    for coder, values in ((_signed, x), (_log, x.square())):
        code, scale, held = coder(values)
        again = coder(held)
        assert torch.equal(again[0], code) and torch.equal(again[1], scale)
        assert torch.equal(again[2], held)


def test_signed_code_rounds_to_the_nearest_multiple_of_its_blocks_smallest_power_of_two():
    x = _wide((8, 96))
    code, scale, held = _signed(x)
    blocks, per = _by_block(x), scale.unsqueeze(-1)
    top = blocks.abs().amax(-1, keepdim=True)
    assert torch.all(top / per <= 127) and torch.all(top / (per / 2) > 127)  # the smallest
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))  # powers of two
    assert torch.all((_by_block(held) - blocks).abs() <= per / 2)
    assert torch.equal(held, code.float() * scale.repeat_interleave(mc.BLOCK, -1))


def test_log_code_keeps_each_blocks_maximum_and_zeros_and_rounds_in_the_log_domain():
    v = _wide((8, 96)).square()
    v[0, :5] = 0.0
    code, top, held = _log(v)
    blocks, held_blocks = _by_block(v), _by_block(held)
    assert torch.equal(held_blocks.amax(-1), blocks.amax(-1))  # the maximum exactly
    assert torch.equal(top, blocks.amax(-1))
    assert torch.all(held[0, :5] == 0) and torch.all(code[0, :5] == 0)
    ratio = (blocks / blocks.amax(-1, keepdim=True)).double()
    inside = (blocks > 0) & (ratio >= 2**-mc.LOG_OCTAVES)
    step = mc.LOG_OCTAVES / 254
    # within the window: at most half a step away in log2 (plus fp32 rounding)
    err = (torch.log2(held_blocks.double()) - torch.log2(blocks.double()))[inside].abs()
    assert err.max() <= step / 2 + 1e-6
    # the nearest code, as the log-domain formula gives it, away from ties
    want = 1 + torch.round(-torch.log2(ratio[inside]) / step)
    got = _by_block(code.to(torch.int64))[inside].double()
    frac = (-torch.log2(ratio[inside]) / step) % 1
    assert torch.equal(got[(frac - 0.5).abs() > 1e-4], want[(frac - 0.5).abs() > 1e-4])
    # below the window: the lowest step, never less than the value
    below = (blocks > 0) & ~inside
    assert below.any()
    assert torch.all(_by_block(code.to(torch.int64))[below] == 255)
    assert torch.all(held_blocks[below] >= blocks[below])


def test_blocks_move_whole_with_rows_and_with_columns_cut_at_multiples_of_32():
    x = _wide((6, 96), seed=1)
    for coder, values in ((_signed, x), (_log, x.square())):
        whole = coder(values)
        for cut in (lambda t: (t[:2], t[2:]), lambda t: (t[:, :64], t[:, 64:])):
            parts = [coder(p) for p in cut(values)]
            dim = 0 if parts[0][0].shape[1] == 96 else 1
            for i in range(3):  # codes, scales and held values
                assert torch.equal(torch.cat([p[i] for p in parts], dim), whole[i])
        # a cut inside a block gives that block two scales: not the whole tensor's
        parts = [coder(p) for p in (values[:, :48], values[:, 48:])]
        assert not torch.equal(torch.cat([p[2] for p in parts], 1), whole[2])


def test_the_same_values_give_the_same_codes_in_every_process():
    """Encoding compares with fixed fp32 thresholds: no libm rounding decides a code."""
    values, thresholds = mc.log_tables(torch.device("cpu"))
    between = thresholds[1:255]
    # a value on a threshold goes to the larger code value (the smaller code)
    t = torch.tensor([[1.0, *between[:3].tolist(), *([0.0] * 28)]])
    code, _, _ = _log(t)
    assert code[0, :4].tolist() == [1, 1, 2, 3]
    assert values[1].item() == 1.0 and values[0].item() == 0.0
    assert math.isclose(values[255].item(), 2**-mc.LOG_OCTAVES, rel_tol=1e-6)
    # Every ratio takes the code its thresholds bracket: 1 + how many lie above it (the
    # estimate from the exponent bits only picks where to look), on and beside each one.
    on = torch.cat([between, between.nextafter(torch.tensor(1.0)),
                    between.nextafter(torch.tensor(0.0)), values[1:]])  # fmt: skip
    spread = torch.exp2(-torch.rand(20000, generator=torch.Generator().manual_seed(3)) * 45)
    ratios = torch.cat([on, spread, torch.tensor([2.0**-126, 1e-30, 1.0])])
    want = 1 + (between[None, :] > ratios[:, None]).sum(1)
    for chunk in ratios.split(32 * 64):
        rows = torch.nn.functional.pad(chunk, (0, -chunk.numel() % 32)).view(-1, 32)
        rows[:, 0] = 1.0  # each block's maximum: its ratios are the values themselves
        got, _, _ = _log(rows)
        expect = 1 + (between[None, :] > rows.reshape(-1)[:, None]).sum(1)
        expect[rows.reshape(-1) == 0] = 0
        assert torch.equal(got.reshape(-1).long(), expect)
    assert want.min() == 1 and want.max() == 255


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, c, s: mc.encode_signed(x, c.to(torch.int16), s), "want torch.int8"),
        (lambda x, c, s: mc.encode_signed(x, c[:, :64], s), r"shape \(4, 96\)"),
        (lambda x, c, s: mc.encode_signed(x, c, s[:, :2]), r"blocks of 32"),
        (lambda x, c, s: mc.encode_signed(x, c, s.double()), "want float32"),
        (lambda x, c, s: mc.encode_log(x, c.view(torch.uint8), s), ">= 0"),
        (lambda x, c, s: mc.decode_log(c, s, x), "want torch.uint8"),
    ],
)
def test_bad_input_is_a_value_error_and_writes_nothing(call, match):
    x = _wide((4, 96))
    code = torch.full((4, 96), 7, dtype=torch.int8)
    scale = torch.full((4, 3), 0.5)
    before = (x.clone(), code.clone(), scale.clone())
    with pytest.raises(ValueError, match=match):
        call(x, code, scale)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, code, scale)))
