"""What the 4-bit codes hold (`containers.update.codes4`): the nearest signed magnitude of the
first moment, a log code of the second that never decodes below zero, and codes that a
decoded block encodes to again (a skipped step changes nothing)."""

from __future__ import annotations

import pytest
import torch

from containers.update.codes4 import LOG_STEPS, SIGNED_MAGNITUDES
from containers.update.forms import MOMENT_CODECS

CODEC = MOMENT_CODECS["4bit"]


def _roundtrip(name: str, values: torch.Tensor) -> tuple[dict, torch.Tensor]:
    stored = CODEC.from_values(name, values, values)
    return stored, CODEC.to_values(name, stored)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    rows, columns = t.shape
    return torch.nn.functional.pad(t, (0, -columns % 32)).view(rows, -1, 32)


@pytest.mark.parametrize("shape", [(6, 64), (5, 40), (3, 2, 96)])
def test_the_first_moment_takes_the_nearest_signed_magnitude_of_its_block_maximum(shape):
    torch.manual_seed(0)
    values = torch.randn(shape) * torch.logspace(-4, 0, shape[-1])
    values[0, :5] = 0.0
    stored, held = _roundtrip("exp_avg", values)
    assert stored["nibbles"].shape == (*shape[:-1], shape[-1] // 2)
    flat, got = values.reshape(-1, shape[-1]), held.reshape(-1, shape[-1])
    top = _blocks(flat.abs()).amax(-1, keepdim=True)
    ratio = _blocks(flat.abs()) / top
    mags = torch.tensor(SIGNED_MAGNITUDES)
    nearest = mags[(ratio.unsqueeze(-1) - mags).abs().argmin(-1)]
    want = torch.sign(_blocks(flat)) * nearest * top
    assert torch.allclose(_blocks(got), want, rtol=1e-6, atol=0)
    assert torch.equal(_blocks(got).abs().amax(-1, keepdim=True), top)  # the maximum is exact
    assert (got[values.reshape(-1, shape[-1]) == 0] == 0).all()


def test_the_second_moment_never_decodes_below_zero_and_is_within_a_half_octave():
    torch.manual_seed(1)
    values = torch.rand(8, 64) ** 8  # spans many octaves below each block's maximum
    values[0, :3] = 0.0
    values[1, 0] = 1e-30  # far below the window: the smallest code, an overestimate
    _, held = _roundtrip("exp_avg_sq", values)
    assert (held >= 0).all() and torch.equal(held == 0, values == 0)
    top = _blocks(values).amax(-1, keepdim=True)
    floor = top * 2.0 ** -(LOG_STEPS - 1)
    inside = _blocks(values) >= _blocks(floor.expand(-1, -1, 32).reshape(8, 64))
    ratio = _blocks(held) / _blocks(values)
    assert (ratio[inside] <= 2**0.5 * (1 + 1e-6)).all()
    assert (ratio[inside] >= 2**-0.5 * (1 - 1e-6)).all()
    assert held[1, 0] == _blocks(held)[1, 0].amax() * 2.0 ** -(LOG_STEPS - 1)


@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
def test_a_decoded_block_encodes_to_the_same_codes_and_scales(name):
    torch.manual_seed(2)
    values = torch.randn(7, 96)
    if name == "exp_avg_sq":
        values = values.square()
    stored, held = _roundtrip(name, values)
    again = CODEC.from_values(name, held, held)
    assert torch.equal(again["nibbles"], stored["nibbles"])
    assert torch.equal(again["scale"], stored["scale"])


def test_rows_of_an_odd_length_keep_bf16_moments():
    assert not CODEC.keeps(torch.zeros(4, 33)) and CODEC.keeps(torch.zeros(4, 34))
    assert CODEC.new("exp_avg", torch.zeros(4, 33)).dtype == torch.bfloat16
