"""The 8-bit moment codes: what they hold, that blocks move whole with rows, bad input."""

from __future__ import annotations

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


def test_every_code_holds_its_log_step_and_encodes_back_to_itself_at_every_scale():
    """Code c >= 1 holds 2^(-40 (c - 1) / 254) of its block's maximum, at most 12 x 2^-23 of
    the exact value away (so codes written when a table of the exact values decoded them read
    as they did, 1.4e-6 apart); the values sit half a step from either neighbour, so each
    encodes back to its own code wherever the block's maximum lies in fp32's normal range."""
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    exact = torch.exp2(-(torch.arange(256, dtype=torch.float64) - 1) * mc.LOG_OCTAVES / 254)
    exact[0] = 0.0
    held = mc.log_values(codes, torch.ones(8, 1)).reshape(-1).double()
    assert held[0] == 0 and held[1] == 1.0  # a block's maximum exactly
    assert ((held - exact).abs() <= 12 * 2**-23 * exact).all()
    for octave in range(-85, 120, 3):  # the smallest code's value stays a normal number
        top = torch.full((8, 1), 2.0**octave * 1.37)
        blocks = mc.log_values(codes, top)
        blocks[:, 0] = top[:, 0]  # each block's maximum
        again, peak = mc.log_codes(blocks)
        want = codes.clone()
        want[:, 0] = 1
        assert torch.equal(again, want) and torch.equal(peak, top), octave


def test_each_value_takes_the_nearest_code_in_log_scale():
    """The code of a ratio r to its block's maximum is 1 + round(-log2(r) 254 / 40), up to
    a few ulp of fp32's log2 at the midpoints between two codes; below the window 255."""
    g = torch.Generator().manual_seed(3)
    ratios = torch.exp2(-torch.rand(64 * 31, generator=g, dtype=torch.float64) * 45)
    rows = torch.cat([torch.ones(64, 1, dtype=torch.float64), ratios.view(64, 31)], 1)
    got, _ = mc.log_codes(rows.float())
    steps = -torch.log2(rows.float().double()) * 254 / mc.LOG_OCTAVES
    want = (1 + torch.floor(steps + 0.5)).clamp(max=255)
    clear = ((steps % 1) - 0.5).abs() > 1e-4  # not at a midpoint
    assert clear.float().mean() > 0.99
    assert torch.equal(got.long()[clear], want.long()[clear])
    assert (want > 254).any() and (got.long()[want > 254] == 255).all()


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
