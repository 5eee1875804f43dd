"""``AttentionProgram.on_blocks``: the same program on larger blocks (what flex runs on CUDA)
gives the same outputs and gradients, and its analytic block lists match the dense truth even
where a block holds both state and token rows."""
import pytest
import torch

import ovqflex
from masks.program import build_program, pad_queries, scaled_unit_queries
from ovqflex.ops.kvm import kvm_program
from ovqflex.ops.ovq import ovq_program
from ovqflex.ops.plain import plain_regions
from ovqflex.ops.vq import vq_program
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close
from tests.masks.test_blocks import listed


def _leaves(T, seed, H=2, D=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, H, T, D, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, g


def _plain(T, block):
    q, k, v, _ = _leaves(T, 1)
    regions = plain_regions(window=23, n_sinks=3)
    return build_program(q, k, v, regions, scale=0.25, block_size=block), (q, k, v)


def _ovq(layout):
    def make(T, block):
        q, k, v, g = _leaves(T, 2)
        beta = (3 + torch.rand(2, generator=g)).requires_grad_()
        p, _, _ = ovq_program(q, k, v, beta, chunk_size=16, max_centroids=20, state_layout=layout,
                              checkpoint_every=2, block_size=block)
        return p, (q, k, v, beta)
    return make


def _kvm(T, block):
    q, k, v, g = _leaves(T, 3)
    w, b = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_(), (0.1 * torch.randn(16, generator=g))
    p, _ = kvm_program(q, k, v, ln_s_weight=w, ln_s_bias=b, chunk_size=16, budget="power_law", growth_factor=3.0,
                       max_state_chunks=None, block_size=block, state_layout="snapshot")
    return p, (q, k, v, w)


def _vq_local_bias(T, block):
    q, k, v, g = _leaves(T, 4)
    beta, local = (3 + torch.rand(2, generator=g)).requires_grad_(), torch.randn(2, generator=g).requires_grad_()
    p, _ = vq_program(q, k, v, torch.randn(2, 10, 16, generator=g), beta, chunk_size=16, local_bias=local,
                      block_size=block, state_layout="snapshot")
    return p, (q, v, beta, local)  # the bias carries local_bias's gradient


PROGRAMS = {"swa-sinks": _plain, "ovq-snapshot": _ovq("snapshot"), "ovq-versioned": _ovq("versioned"),
            "kvm-powerlaw": _kvm, "vq-local-bias": _vq_local_bias}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_on_blocks_keeps_outputs_and_gradients(name):
    T = 70
    p, leaves = PROGRAMS[name](T, 16)
    big = p.on_blocks(128)
    g = big.geom
    assert (g.block_q, g.block_kv, g.n_state, g.q_len) == (128, 128, p.geom.n_state, T)
    assert g.q_pad % 128 == 0 and g.kv_len % 128 == 0 and g.kv_tokens >= g.q_pad
    w = torch.randn(p.q.shape[0], p.q.shape[1], T, p.v.shape[-1], generator=torch.Generator().manual_seed(T))
    ref = ovqflex.attend(p, "dense")
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves, retain_graph=True)
    for backend in ("blocked", "dense"):
        out = ovqflex.attend(big, backend)
        grads = torch.autograd.grad((out * w).sum(), leaves, retain_graph=True)
        assert_close(out, ref, FWD_TOL[torch.float32], f"{backend} forward")
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            assert_close(a, b, GRAD_TOL[torch.float32], f"{backend} grad of leaf {i}", floor=0.1)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_on_blocks_lists_match_the_dense_mask(name):
    """Every visible 128-block is listed, and a block listed full is fully visible: also the
    blocks that straddle the state/token boundary (the state keeps its 16-row padding)."""
    p, _ = PROGRAMS[name](150, 16)
    big = p.on_blocks(128)
    g, lay = big.geom, big.layout
    if name != "swa-sinks":
        assert g.n_state % 128, "the case must have a block holding state and token rows"
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1)
    q = torch.arange(g.q_pad).view(1, 1, -1, 1)
    kv = torch.arange(g.kv_len).view(1, 1, 1, -1)
    m = big.mask_mod(b, h, q, kv).expand(2, 2, g.q_pad, g.kv_len)
    t = m.reshape(2, 2, g.n_q_blocks, 128, g.n_kv_blocks, 128)
    any_visible, all_visible = t.any(-1).any(-2).any(0).any(0), t.all(-1).all(-2).all(0).all(0)
    partial, full = listed(lay.kv_num, lay.kv_idx, g), listed(lay.full_num, lay.full_idx, g)
    assert not (partial & full).any()
    assert ((partial | full) >= any_visible).all(), "a visible block is not listed"
    assert (full <= all_visible).all(), "a block listed full is not fully visible"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_mask_mod_is_the_union_of_every_regions_contains(name):
    """The ``mask_mod`` runs a test shared by several regions once (the versioned liveness,
    ``Region.shared_test``): it still sees exactly the union of each region's own ``contains``,
    also on larger blocks (token rows past the state's padding)."""
    for p in (PROGRAMS[name](150, 16)[0], PROGRAMS[name](150, 16)[0].on_blocks(128)):
        g = p.geom
        b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1)
        q, kv = torch.arange(g.q_pad).view(1, 1, -1, 1), torch.arange(g.kv_len).view(1, 1, 1, -1)
        union = torch.zeros(2, 2, g.q_pad, g.kv_len, dtype=torch.bool)
        for region, params in zip(p.regions, p.params):
            union |= region.contains(params, q, kv, b, h)
        assert torch.equal(p.mask_mod(b, h, q, kv).expand_as(union), union)
        shared = [r.shared_test for r in p.regions if r.shared_test is not None]
        assert len(shared) == (2 if "versioned" in name else 0) and len(set(shared)) <= 1


def test_on_blocks_is_the_identity_at_the_own_block_and_refuses_a_non_multiple():
    p, _ = _plain(40, 32)
    assert p.on_blocks(32) is p
    with pytest.raises(ValueError, match="multiple of the program's block size 32"):
        p.on_blocks(48)


def test_kv_rows_are_the_state_then_the_tokens_each_padded_with_zeros_to_the_block():
    """``build_program`` lays out ``[state ; zeros ; tokens ; zeros]`` (state and tokens each padded to the
    block size), the state padding with a ``-inf`` bias, and passes gradients to both parts unchanged."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g).requires_grad_() for _ in range(3))
    sk, sv = (torch.randn(1, 2, 5, 8, generator=g).requires_grad_() for _ in range(2))
    p = build_program(q, k, v, plain_regions(window=7), scale=0.5, state_k=sk, state_v=sv,
                      state_bias=torch.zeros(1, 2, 5), block_size=16)
    for laid, state, tokens in ((p.k, sk, k), (p.v, sv, v)):
        assert laid.shape == (1, 2, 16 + 32, 8)
        assert torch.equal(laid[:, :, :5], state) and torch.equal(laid[:, :, 16:36], tokens)
        assert not laid[:, :, 5:16].any() and not laid[:, :, 36:].any()
    assert torch.equal(p.bias[..., 5:16], torch.full((1, 2, 11), float("-inf"))) and not p.bias[..., 16:].any()
    w = torch.randn(p.k.shape, generator=g)
    grads = torch.autograd.grad((p.k * w).sum() + (p.v * w).sum(), (sk, k, sv, v))
    for grad, rows in zip(grads, (slice(0, 5), slice(16, 36)) * 2):
        assert torch.equal(grad, w[:, :, rows])


@pytest.mark.parametrize("state_k, state_v", [(None, (1, 1, 3, 8)), ((1, 1, 3, 8), None), ((1, 1, 3, 8), (1, 1, 4, 8)),
                                              ((1, 1, 3, 8), (1, 2, 3, 8))],
                         ids=["values-only", "keys-only", "other-rows", "other-heads"])
def test_state_rows_need_both_keys_and_values(state_k, state_v):
    q = k = v = torch.zeros(1, 1, 16, 8)
    state = [None if shape is None else torch.zeros(shape) for shape in (state_k, state_v)]
    with pytest.raises(ValueError, match=r"state_k and state_v must both be given with matching \[B, H, S\]"):
        build_program(q, k, v, plain_regions(window=4), scale=1.0, state_k=state[0], state_v=state[1])


def _token_major(q: torch.Tensor) -> bool:
    """``q [B, H, T, D]`` laid out ``[B, T, H, D]`` in memory (flex's output then merges heads as a view)."""
    return q.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_padded_queries_are_written_token_major(name):
    """Padding writes a program's queries [B, T, H, D] in memory whatever the layout given (here contiguous
    [B, H, T, D]), also on flex's larger blocks: flex's output follows it (masks/program.py). Compiled, every
    query writer is held to it by tests/ovqflex/layers/test_heads.py (inductor's code)."""
    p, _ = PROGRAMS[name](70, 16)  # 70 queries: padded to 80
    assert not _token_major(_leaves(70, 0)[0])
    assert _token_major(p.q), p.q.stride()
    assert _token_major(p.on_blocks(128).q)


def test_scaled_unit_queries_and_padding_keep_their_values():
    g = torch.Generator().manual_seed(5)
    q, beta = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64)
    want = beta.view(1, 3, 1, 1) * q / q.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(scaled_unit_queries(q, beta), want, rtol=1e-14, atol=0)
    # eager follows the layout given: the layers' queries, views of a [B, T, ...] projection, stay token-major
    projected = torch.randn(2, 9, 2 * 3 * 8, generator=g, dtype=torch.float64).view(2, 9, 2, 3, 8)[:, :, 0]
    assert _token_major(scaled_unit_queries(projected.transpose(1, 2), beta))
    padded = pad_queries(q, 16)
    assert padded.shape == (2, 3, 16, 8) and _token_major(padded)
    assert torch.equal(padded[:, :, :9], q) and not padded[:, :, 9:].any()
    assert pad_queries(q, 9) is q  # already long enough: as given
