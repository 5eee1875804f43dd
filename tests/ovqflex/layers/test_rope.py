"""RoPE against a complex-number rotation written from the definition."""
import pytest
import torch

from ovqflex.layers.rope import apply_rope


def rope_complex(x, pos, rope_dims, base, interleaved):
    r = rope_dims
    xr = x[..., :r].double()
    if interleaved:
        pairs = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        pairs = torch.complex(xr[..., : r // 2], xr[..., r // 2:])
    theta = torch.tensor([base ** (-2 * i / r) for i in range(r // 2)], dtype=torch.float64)
    rot = pairs * torch.polar(torch.ones(len(pos), r // 2, dtype=torch.float64), pos.double()[:, None] * theta)
    if interleaved:
        out = torch.stack([rot.real, rot.imag], -1).flatten(-2)
    else:
        out = torch.cat([rot.real, rot.imag], -1)
    return torch.cat([out, x[..., r:].double()], -1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rope_dims", [32, 16, 0], ids=["full", "partial", "none"])
def test_rope_matches_complex_rotation(interleaved, rope_dims):
    x = torch.randn(2, 3, 50, 32)
    pos = torch.arange(50) + 7
    got = apply_rope(x, pos, rope_dims, 500.0, interleaved)
    want = rope_complex(x, pos, rope_dims, 500.0, interleaved) if rope_dims else x.double()
    assert torch.allclose(got.double(), want, atol=1e-5)
    if rope_dims:  # written token-major, [B, T, H, D] in memory, as flex's queries are (masks/program.py)
        assert got.transpose(1, 2).is_contiguous(), got.stride()


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_a_float64_input_is_rotated_in_float64(interleaved):
    """Angles and rotation in fp64 for fp64 x: fp32 angles at positions near 60,000 are off by ~1e-3 rad."""
    x = torch.randn(1, 2, 20, 16, dtype=torch.float64)
    pos = torch.arange(20) + 60_000
    got = apply_rope(x, pos, 16, 10000.0, interleaved)
    assert got.dtype == torch.float64
    assert torch.allclose(got, rope_complex(x, pos, 16, 10000.0, interleaved), rtol=0, atol=1e-10)


def test_a_float64_rotation_reads_positions_past_fp32_s_integers_exactly():
    """Positions are cast to the angles' dtype once: 2^24 + 1 is not an fp32 number (it rounds to 2^24), and
    the first pair's angle (the position, in radians) would be off by 1 rad."""
    x = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    pos = torch.tensor([2**24 + 1, 2**24 + 3])
    assert torch.allclose(apply_rope(x, pos, 4), rope_complex(x, pos, 4, 10000.0, False), rtol=0, atol=1e-9)


def test_rope_is_relative():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    dots = [
        (apply_rope(q, torch.tensor([a + s])) * apply_rope(k, torch.tensor([b + s]))).sum()
        for a, b, s in [(5, 2, 0), (5, 2, 40)]
    ]
    assert torch.allclose(dots[0], dots[1], atol=1e-5)


@pytest.mark.parametrize("rope_dims", [7, 18, -2])
def test_rope_bad_dims(rope_dims):
    with pytest.raises(ValueError, match=rf"rope_dims must be even and in \[0, 16\], got {rope_dims}"):
        apply_rope(torch.randn(1, 1, 4, 16), torch.arange(4), rope_dims)
