"""KVM's chunk routing (recurrences/kvm/routing.py) follows the paper's rule (KVM paper, arXiv
2605.09877, §4 and appendix A), written here from the paper's pseudo-code: append the least
redundant tokens, merge the others into ``argmax_{i >= S} (g_j kbar_j) . LN_s(s+_i)``."""
import pytest
import torch
import torch.nn.functional as F

from recurrences.kvm import kvm_route_chunk


def _chunk(seed, B, H, C, D, m):
    """A routing state ``[B, H, m + C + 1, D]`` with ``m`` live rows of fp32 key sums, a chunk's
    memory keys ``[B, H, C, D]`` and gates ``[B, H, C]``, ``LN_s`` weight and bias ``[D]``."""
    g = torch.Generator().manual_seed(seed)
    state = torch.zeros(B, H, m + C + 1, D)
    state[:, :, :m] = torch.randn(B, H, m, D, generator=g) * torch.rand(B, H, m, 1, generator=g).mul(3).add(0.5)
    ok = F.layer_norm(torch.randn(B, H, C, D, generator=g), (D,))
    og = 1.0 + F.elu(2 * torch.randn(B, H, C, generator=g))
    return state, ok, og, 1.0 + 0.2 * torch.randn(D, generator=g), 0.2 * torch.randn(D, generator=g)


def _papers_merge_logits(state, m, ok, og, appended, w, b, sink_len):
    """The pseudo-code's logits ``(g kbar) @ LN_s(s+)^T`` over the state after the append (the
    founders' keys as rows ``m, m+1, …`` in temporal order), sinks at ``-inf``: ``[B, H, C, m + n_app]``."""
    B, H, C, D = ok.shape
    founders = [ok[bb, hh][appended[bb, hh]] for bb in range(B) for hh in range(H)]
    s_plus = torch.stack([torch.cat([state[bb, hh, :m], founders[bb * H + hh]]) for bb in range(B) for hh in range(H)])
    logits = (og[..., None] * ok) @ F.layer_norm(s_plus.view(B, H, -1, D), (D,), w, b).transpose(-1, -2)
    logits[..., :sink_len] = float("-inf")
    return logits


@pytest.mark.parametrize("sink_len", [0, 1, 3], ids=lambda s: f"sinks{s}")
@pytest.mark.parametrize("m, n_app", [(16, 0), (40, 5), (64, 16), (200, 11)], ids=lambda v: str(v))
def test_merge_targets_are_the_papers_gated_argmax(m, n_app, sink_len):
    """Every merged token's row is the argmax of the paper's gated logits, wherever their best two
    rows are not a near-tie (the gate is applied to the products, not the key: the same maximum,
    rounded differently); near-ties are rare, so the check covers almost every token."""
    B, H, C, D = 2, 3, 32, 16
    checked = total = 0
    for seed in range(4):
        state, ok, og, w, b = _chunk(seed, B, H, C, D, m)
        target, appended = kvm_route_chunk(state, m, n_app, ok, og, w, b, sink_len, 1e-5)
        # append: the n_app lowest of each token's best similarity to the current rows, kept in temporal order
        score = (ok @ F.layer_norm(state[:, :, :m], (D,), w, b).transpose(-1, -2)).amax(-1)
        lowest = torch.zeros_like(appended).scatter(2, score.argsort(dim=-1, stable=True)[..., :n_app], True)
        assert torch.equal(appended, lowest)
        assert torch.equal(target[appended], (m + appended.cumsum(-1) - 1)[appended])
        logits = _papers_merge_logits(state, m, ok, og, appended, w, b, sink_len)
        top2 = logits.topk(2, dim=-1).values
        clear = ~appended & ((top2[..., 0] - top2[..., 1]) > 1e-5 * top2[..., 0].abs())
        assert torch.equal(target[clear], logits.argmax(-1)[clear])
        checked, total = checked + int(clear.sum()), total + int((~appended).sum())
    assert checked >= 0.98 * total, (checked, total)


def test_a_zero_gate_merges_into_the_first_row_after_the_sinks():
    """A gate that underflows to 0 makes every gated logit 0: the paper's argmax is then the first
    row after the sinks, whatever the key."""
    state, ok, og, w, b = _chunk(0, 1, 2, 16, 8, 24)
    og[:, :, ::3] = 0.0
    for sink_len in (0, 2):
        target, appended = kvm_route_chunk(state, 24, 4, ok, og, w, b, sink_len, 1e-5)
        zero = (og == 0) & ~appended
        assert zero.any() and (target[zero] == sink_len).all()
        assert (target[~appended & (og > 0)] != sink_len).any()  # the others by their keys


@pytest.mark.parametrize("sink_len, error, match", [
    (16, ValueError, "sink_len must be < chunk_size=16 \\(the initial state\\), got 16"),
    (40, ValueError, "sink_len must be < chunk_size=16 \\(the initial state\\), got 40"),
    (-1, ValueError, "sink_len must be >= 0, got -1"),
    (True, TypeError, "sink_len must be an int, got bool True")], ids=["chunk", "past-chunk", "negative", "bool"])
def test_sinks_outside_the_initial_state_are_refused_by_every_router(sink_len, error, match):
    """Sinks are rows of the initial state (the first chunk's ``C`` rows): ``sink_len >= C`` would leave a
    merging token no row to join. Refused by name by the routers and the options, not routed into row 0."""
    from recurrences.kvm import KVMSchedule, route_kvm
    from recurrences.kvm.routing_static import StaticKVMRouter
    from recurrences.reference.kvm import kvm_attention_reference
    from ovqflex.ops.kvm import KVMOptions

    C, D = 16, 4
    kbar, gate = torch.zeros(1, 1, 4 * C, D), torch.ones(1, 1, 4 * C)  # refused before any value is read
    ln = torch.ones(D), torch.zeros(D)
    with pytest.raises(error, match=match):
        route_kvm(kbar, gate, *ln, schedule=KVMSchedule(C, 1), sink_len=sink_len)
    with pytest.raises(error, match=match):
        StaticKVMRouter(tuple(kbar.shape), chunk_size=C, n_bswa_chunks=1, sizes=[0, C, C, C], sink_len=sink_len,
                        compile=False)
    with pytest.raises(error, match=match):
        KVMOptions(chunk_size=C, sink_len=sink_len)
    with pytest.raises(ValueError, match=f"sink_len must be an int in \\[0, chunk_size=16\\) .*got {sink_len!r}"):
        kvm_attention_reference(kbar, kbar, kbar, ln_s_weight=ln[0], ln_s_bias=ln[1], chunk_size=C, n_bswa_chunks=1,
                                sink_len=sink_len)
