"""VQ codebook quantizer: assignment, estimators, EMA k-means, dead codes, metrics (docs/design.md §4.4)."""
import pytest
import torch
import torch.nn.functional as F

from recurrences.vq import assign_codes, codebook_metrics, commitment_loss, ema_update_, quantize


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_assignment_is_nearest_code_in_euclidean_distance():
    k = torch.randn(2, 3, 50, 8) * 3.0  # any norm: keys are normalized
    cb = torch.randn(3, 10, 8)
    codes = assign_codes(k, cb)
    kn, cbn = F.normalize(k, dim=-1), F.normalize(cb, dim=-1)
    dist = (kn[:, :, :, None] - cbn[None, :, None]).square().sum(-1)  # [B, H, T, N]
    assert torch.equal(codes, dist.argmin(-1))
    assert codes.dtype == torch.int64 and not codes.requires_grad
    assert torch.equal(assign_codes(k.to(torch.bfloat16).float(), cb), assign_codes(k.to(torch.bfloat16), cb))


def test_code_bias_lets_an_idle_code_win():
    k, cb = unit(1, 1, 20, 4), unit(1, 3, 4, seed=1)
    bias = torch.tensor([[0.0, 0.0, 5.0]])
    assert (assign_codes(k, cb, bias) == 2).all()


@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_quantized_keys_are_codes_and_gradient_reaches_the_keys(estimator):
    kn = unit(2, 2, 30, 8).requires_grad_()
    cb = unit(2, 5, 8, seed=1).requires_grad_()
    codes = assign_codes(kn, cb)
    k_hat = quantize(kn, cb, codes, estimator)
    expected = cb.detach()[torch.arange(2).view(1, 2, 1), codes]
    assert torch.allclose(k_hat, expected, atol=1e-6)
    w = torch.randn(k_hat.shape)
    dk, dcb = torch.autograd.grad((k_hat * w).sum(), (kn, cb), allow_unused=True)
    if estimator == "ste":
        assert torch.equal(dk, w), "straight-through: dL/dk == dL/dk_hat"
        assert dcb is None
    else:  # DiVeQ: the key gets the gradient plus a distance term; the codebook gets a gradient too
        assert dk.abs().sum() > 0 and not torch.allclose(dk, w)
        assert dcb is not None and dcb.abs().sum() > 0


def test_commitment_loss_pulls_keys_toward_codes():
    kn = unit(1, 2, 16, 8).requires_grad_()
    cb = unit(2, 4, 8, seed=1)
    codes = assign_codes(kn, cb)
    loss = commitment_loss(kn, cb, codes)
    c = cb[torch.arange(2).view(1, 2, 1), codes]
    assert torch.allclose(loss, (kn - c).square().sum(-1).mean())
    (g,) = torch.autograd.grad(loss, kn)
    stepped = kn.detach() - 0.1 * g
    assert commitment_loss(stepped, cb, codes) < loss


def test_ema_update_moves_each_used_code_toward_the_mean_of_its_keys():
    H, N, D = 2, 6, 8
    cb = unit(H, N, D, seed=2)
    kn = unit(3, H, 40, D, seed=3)
    codes = assign_codes(kn, cb)
    onehot = F.one_hot(codes, N).float()  # [B, H, T, N]
    n = onehot.sum((0, 2))  # [H, N]
    mean = torch.einsum("bhtn,bhtd->hnd", onehot, kn) / n.clamp_min(1)[..., None]
    used = n > 0
    assert used.sum() >= H * N - 2
    # decay 0: the code becomes exactly the (normalized) mean of its keys
    c0, counts, sums = cb.clone(), torch.ones(H, N), cb.clone()
    dead = ema_update_(c0, counts, sums, kn, codes, decay=0.0, dead_threshold=0.0)
    assert not dead.any()
    assert torch.allclose(c0[used], F.normalize(mean, dim=-1)[used], atol=1e-6)
    assert torch.allclose(counts[used], n[used])
    # decay 0.9: each used code moves toward its mean (cosine to the mean grows), stays unit
    c1, counts, sums = cb.clone(), torch.ones(H, N), cb.clone()
    ema_update_(c1, counts, sums, kn, codes, decay=0.9, dead_threshold=0.0)
    cos = lambda a: F.cosine_similarity(a, mean, dim=-1)  # noqa: E731
    assert (cos(c1)[used] > cos(cb)[used]).all()
    assert torch.allclose(c1.norm(dim=-1), torch.ones(H, N), atol=1e-6)
    assert torch.equal(c1[~used], cb[~used])  # an unused code keeps its direction (its count decays)


def test_dead_codes_are_revived_with_batch_keys():
    H, N, D = 1, 4, 8
    cb = unit(H, N, D, seed=4)
    cb[0, 3] = -cb[0, 0]  # code 3 points away from every key: never chosen
    kn = F.normalize(cb[0, 0] + 0.1 * torch.randn(1, H, 32, D), dim=-1)
    codes = assign_codes(kn, cb)
    assert not (codes == 3).any()
    counts, sums = torch.ones(H, N), cb.clone()
    counts[0, 3] = 0.0105  # after one decay of 0.9: below the threshold 0.01
    torch.manual_seed(0)
    dead = ema_update_(cb, counts, sums, kn, codes, decay=0.9, dead_threshold=0.01)
    assert dead[0, 3] and dead.sum() == 1
    revived = cb[0, 3]
    assert torch.isclose((kn[0, 0] @ revived).max(), torch.tensor(1.0), atol=1e-5), "revived as a batch key"
    assert counts[0, 3] == 1.0
    assert (assign_codes(kn, cb) == 3).any(), "the revived code wins tokens again"


def test_metrics_of_a_known_assignment():
    cb = torch.eye(4).view(1, 4, 4)
    codes = torch.tensor([[[0, 1, 2, 3, 0, 1, 2, 3]]])
    kn = cb[0][codes]
    m = codebook_metrics(kn, cb, codes)
    assert m["usage"] == 1 and torch.isclose(m["perplexity"], torch.tensor(4.0)) and m["unused_codes"] == 0
    assert m["rel_quant_error"] == 0
    codes2 = torch.zeros_like(codes)
    m2 = codebook_metrics(kn, cb, codes2)
    assert m2["usage"] == 0.25 and torch.isclose(m2["perplexity"], torch.tensor(1.0)) and m2["unused_codes"] == 3
    assert torch.isclose(m2["rel_quant_error"], torch.tensor(6 / 8 * 2))  # 6 of 8 keys at distance^2 2
    # two heads: the mean of the heads' perplexities (4 and 1), not the perplexity of their mean entropy (2)
    both = torch.cat([codes, codes2], dim=1)
    m3 = codebook_metrics(cb[0][both], cb.expand(2, 4, 4), both)
    assert torch.isclose(m3["perplexity"], torch.tensor(2.5)) and m3["usage"] == (1 + 0.25) / 2
