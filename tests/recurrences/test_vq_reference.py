"""The VQ reference's ``gaps``: how far forced codes fall short of the best code, the measure of the
near-tie rule (docs/design.md §4.4, §9). The reference itself is tested against the fused op in
tests/ovqflex/ops/test_vq.py."""
import pytest
import torch
import torch.nn.functional as F

from recurrences.reference import vq_attention_reference


@pytest.mark.parametrize("biased", [False, True], ids=["plain", "code-bias"])
def test_gaps_of_forced_codes(biased):
    g = torch.Generator().manual_seed(0)
    B, H, T, D, N = 1, 2, 10, 8, 5
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    codebook, beta = torch.randn(H, N, D, generator=g), torch.ones(H)
    bias = 0.1 * torch.randn(H, N, generator=g) if biased else None
    run = lambda **kw: vq_attention_reference(q, k, v, codebook, beta, chunk_size=4, code_bias=bias, **kw)  # noqa: E731
    own = run()
    assert (own.gaps == 0).all() and (run(codes=own.codes).gaps == 0).all()
    codes = (own.codes + 1) % N  # every key on another code
    sims = torch.einsum("bhtd,hnd->bhtn", F.normalize(k, dim=-1), F.normalize(codebook, dim=-1))
    if biased:
        sims = sims + bias[None, :, None, :]
    want = sims.amax(-1) - sims.gather(-1, codes[..., None])[..., 0]
    torch.testing.assert_close(run(codes=codes).gaps, want)
    assert (want > 0).all()
