"""Prefill + decode == full forward (docs/design.md §6, §9.6) for every cached layer and HybridLM.

The full forward runs the fused program; the cache path runs a prefill (fused, plus a
route replay) and then per-chunk decode over explicit rows. They share only the
projections and the routing steps, so agreement checks the caches' bookkeeping:
which rows each query sees, when chunks are absorbed, conv tails and positions. The
non-softmax recurrences (linear, DeltaNet, VLA) carry their state instead: agreement
checks the continued recurrence (VLA: refreshes on the absolute schedule).
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ovqflex
from ovqflex.cache import DeltaNetCache, KVMCache, LinearAttentionCache, OVQCache, PlainCache, VLACache
from ovqflex.layers.heads import MultiHeadProjection
from ovqflex.methods import METHODS, Method
from ovqflex.models import HybridLM
from ovqflex.models.config import HybridConfig
from tests.helpers import FWD_TOL, assert_close, perturbed

HIDDEN, HEADS = 32, 2

LAYERS = {
    "full-rope-conv": lambda: ovqflex.CausalAttention(HIDDEN, HEADS, rope=True, qk_conv=3, backend="dense"),
    "full-nope-qknorm-logn20": lambda: ovqflex.CausalAttention(HIDDEN, HEADS, qk_norm=True, logn_len=20,
                                                               backend="dense"),
    "swa-20-sinks": lambda: ovqflex.SlidingWindowAttention(HIDDEN, HEADS, window=20, n_sinks=2, backend="dense"),
    "bswa-2x16": lambda: ovqflex.SlidingWindowAttention(HIDDEN, HEADS, block_window=2, chunk_size=16,
                                                        backend="dense"),
    # a convolution of width 1 (a scale per channel): its cache keeps no earlier token
    "swa-20-conv1": lambda: ovqflex.SlidingWindowAttention(HIDDEN, HEADS, window=20, qk_conv=1, backend="dense"),
    "ovq-plateau": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=24, backend="dense"),
    "ovq-full-random-norm-conv": lambda: ovqflex.OVQAttention(
        HIDDEN, HEADS, chunk_size=16, max_centroids=40, growth="full", seeding="random", normalize_centroids=True,
        qk_conv=2, backend="dense"),
    "ovq-linear": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=30, growth="linear",
                                               growth_horizon=64, backend="dense"),
    # a cap far above any context: the decode cache grows with the dictionary (see the test below)
    "ovq-huge-cap": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=10**9, backend="dense"),
    "kvm-fixed": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=16, backend="dense"),
    "kvm-powerlaw-uncapped-conv": lambda: ovqflex.KVMAttention(
        HIDDEN, HEADS, chunk_size=16, budget="power_law", growth_factor=4.0, max_state_chunks=None, qk_conv=3,
        backend="dense"),
    # state values as gated means (s_v / count: each token counted once, whatever its gate), LN_s at eps 1e-2
    "kvm-saturation-nb3-means": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=16, n_bswa_chunks=3,
                                                             budget="saturation", saturation_n=40, max_state_chunks=3,
                                                             use_vlens=False, ln_eps=1e-2, backend="dense"),
    "kvm-ablations": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=16, n_bswa_chunks=1, sink_len=0,
                                                  use_gate=False, use_vlens=False, use_temperatures=False,
                                                  backend="dense"),
    "vq": lambda: ovqflex.VQAttention(HIDDEN, HEADS, chunk_size=16, codebook_size=12, backend="dense"),
    "vq-localbias-conv-diveq": lambda: ovqflex.VQAttention(HIDDEN, HEADS, chunk_size=16, codebook_size=12,
                                                           local_bias=True, qk_conv=3, estimator="diveq",
                                                           backend="dense"),
    "longvq": lambda: ovqflex.LongVQBlock(HIDDEN, HEADS, chunk_size=16, codebook_size=12, backend="dense"),
    "linear": lambda: ovqflex.LinearAttention(HIDDEN, HEADS, chunk_size=16),
    "linear-outnorm-conv": lambda: ovqflex.LinearAttention(HIDDEN, HEADS, chunk_size=16, out_norm=True, qk_conv=3),
    "deltanet": lambda: ovqflex.DeltaNetAttention(HIDDEN, HEADS, chunk_size=16),
    "deltanet-outnorm-conv": lambda: ovqflex.DeltaNetAttention(HIDDEN, HEADS, chunk_size=16, out_norm=True,
                                                               qk_conv=2),
    "vla": lambda: ovqflex.VLAAttention(HIDDEN, HEADS),  # refresh every 20 tokens, chunk 20
    "vla-outnorm-conv-r12c4": lambda: ovqflex.VLAAttention(HIDDEN, HEADS, out_norm=True, qk_conv=3, refresh_every=12,
                                                           refresh_eps=0.05, chunk_size=4),
    "vla-norefresh": lambda: ovqflex.VLAAttention(HIDDEN, HEADS, refresh_every=0, chunk_size=16, lambda0=1.0),
}


def _perturbed(layer):
    """Move the layer off its init (unit LayerNorms, temperatures 1, a DiVeQ codebook's codes never idle) so
    every parameter and the codes' no-use bonus matter; eval mode."""
    return perturbed(layer).eval()


def _stream(model, x, t1, steps):
    """Prefill ``x[:, :t1]``, then decode the rest in ``steps`` sized calls (cycled)."""
    y, cache = model(x[:, :t1], use_cache=True)
    ys, i, k = [y], t1, 0
    while i < x.shape[1]:
        n = min(steps[k % len(steps)], x.shape[1] - i)
        y, cache = model(x[:, i:i + n], cache=cache)
        ys.append(y)
        i, k = i + n, k + 1
    return torch.cat(ys, dim=1), cache


@pytest.mark.parametrize("name", list(LAYERS))
@given(t1=st.integers(1, 100), t2=st.integers(1, 60),
       steps=st.one_of(st.just([1]), st.lists(st.integers(1, 40), min_size=1, max_size=4)))
def test_prefill_then_decode_equals_full_forward(name, t1, t2, steps):
    torch.manual_seed(t1 * 1000 + t2)
    layer = _perturbed(LAYERS[name]())
    x = torch.randn(2, t1 + t2, HIDDEN)
    norm = getattr(layer, "out_norm", None)
    seen = []  # what the output norm is handed, call by call: [B, H, T, d]
    hook = norm.register_forward_pre_hook(lambda m, args: seen.append(args[0])) if norm is not None else None
    with torch.no_grad():
        full = layer(x)
        streamed, cache = _stream(layer, x, t1, steps)
    assert cache.position == t1 + t2
    what, tol = f"{name} t1={t1} t2={t2} steps={steps}", FWD_TOL[torch.float32]
    if hook is not None:
        hook.remove()
        assert_close(torch.cat(seen[1:], dim=2), seen[0], tol, f"{what}, before the output norm")
        tol *= _norm_amplification(seen[0], norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps)
    assert_close(streamed, full, tol, what)


def _norm_amplification(o, eps):
    """How much an RMS norm of each head's output ``o [B, H, T, d]`` can raise a relative error of ``o``: the
    tensor's rms over the smallest divisor ``sqrt(mean(o^2) + eps)`` of a head and token, at least 1. A head
    whose output cancels to about 0 (its query nearly orthogonal to the keys so far) has its rounding, at the
    scale of the terms that cancelled, divided by that small rms (seen with DeltaNet at the first token: rms
    8.7e-6 where the tensor's is 0.13, so 375 here; 1.0e-5 after the norm, 2.4e-7 elsewhere). Over 100 random
    draws of this test's lengths: median 3.2 (linear), 34 (DeltaNet), 8.6 (VLA), at most 1,031 (DeltaNet);
    what the norm is handed is compared at the plain tolerance first."""
    ms = o.pow(2).mean(-1)  # [B, H, T]; every row has d entries, so the tensor's mean square is their mean
    return max(1.0, (ms.mean().sqrt() / (ms + eps).sqrt().min()).item())


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_float64_layer_decodes_like_its_float64_forward(name):
    """``layer.double()``: prefill and decode give float64 outputs equal to the float64 forward, to
    float64 precision where the cache holds float64 tensors (plain attention, the recurrences), and
    within 1e-6 where it keeps its state and routing copies in fp32 (OVQ, KVM, VQ, LongVQ:
    docs/precision.md; measured 2e-8 to 4e-8 here, 5e-10 for LongVQ)."""
    torch.manual_seed(0)
    layer = _perturbed(LAYERS[name]()).double()
    x = torch.randn(2, 61, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        streamed, cache = _stream(layer, x, 37, [1, 5, 17])
    assert cache.position == 61 and streamed.dtype == full.dtype == torch.float64
    fp32_state = name.startswith(("ovq", "kvm", "vq", "longvq"))
    assert_close(streamed, full, 1e-6 if fp32_state else FWD_TOL[torch.float64], f"{name} in float64")


@pytest.mark.parametrize("name", ["ovq-plateau", "kvm-fixed", "swa-20-sinks", "vq", "longvq", "linear-outnorm-conv",
                                  "deltanet-outnorm-conv", "vla-outnorm-conv-r12c4"])
def test_a_cache_can_be_continued_twice(name):
    """Decoding does not mutate the cache it was given: one prefix, two continuations, each across two chunk
    ends (chunks of 16). The prefix is a prefill and a decode across a chunk end, so the cache has room to
    spare: OVQ's dictionary, allocated at its size by the prefill, grows into new tensors at the first chunk
    end, and the continuations' chunk ends then write rows the given cache holds."""
    layer = _perturbed(LAYERS[name]())
    x = torch.randn(1, 90, HIDDEN)
    with torch.no_grad():
        _, cache = layer(x[:, :40], use_cache=True)
        _, cache = layer(x[:, 40:52], cache=cache)
        before = [t.clone() for t in cache.tensors()]
        a, _ = layer(x[:, 52:], cache=cache)
        b, _ = layer(x[:, 52:], cache=cache)
    assert torch.equal(a, b)
    assert all(torch.equal(t, u) for t, u in zip(before, cache.tensors()))


def test_ovq_random_seeding_decodes_through_chunks_that_found_no_slot():
    """Decode draws a chunk's seeding keys as routing does, once per chunk whether it founds slots or not:
    plateau N = 10 of 16-token chunks founds none in chunks 3 and 4 and one in chunk 5, which chunk 6 reads."""
    from recurrences.ovq.routing import dictionary_sizes

    assert dictionary_sizes(7, 16, 10) == [0, 6, 7, 8, 8, 8, 9, 9]
    torch.manual_seed(0)
    layer = _perturbed(ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=10, seeding="random", seed=5,
                                           backend="dense"))
    x = torch.randn(2, 112, HIDDEN)
    with torch.no_grad():
        full = layer(x)
        streamed, _ = _stream(layer, x, 40, [1, 7, 16])
    assert_close(streamed, full, FWD_TOL[torch.float32], "OVQ random seeding, decoded from token 40")


PATTERNS = ["swa,ovq", "kvm", "full,bswa", "swa,nope", "swa,vq", "longvq", "swa,linear", "deltanet", "vla"]


def _tokens_without_repeated_pairs(batch: int, length: int, vocab: int) -> torch.Tensor:
    """``[batch, length]`` tokens (global generator) in which no (previous, current) pair occurs twice. With
    ``qk_conv=2`` the first layer's keys are functions of such pairs: a pair drawn twice gives two bitwise equal
    keys in the full forward, whose state rows then tie exactly, while prefill + decode computes the two keys in
    different calls, 3e-7 apart, and rounding breaks the tie (docs/design.md §6; KVM, t1 = 15, t2 = 48: tokens
    27, 27, 27 at 13-15 made chunk 0's rows 14 and 15 equal, and chunk 1's merges split 4 : 0 or 2 : 2)."""
    rows = []
    for _ in range(batch):
        seq, seen = [int(torch.randint(vocab, ()))], set()
        for _ in range(length - 1):
            free = [t for t in range(vocab) if (seq[-1], t) not in seen]
            assert free, f"token {seq[-1]} has no unused successor left"
            seq.append(free[int(torch.randint(len(free), ()))])
            seen.add((seq[-2], seq[-1]))
        rows.append(seq)
    return torch.tensor(rows)


@pytest.mark.parametrize("pattern", PATTERNS)
@given(t1=st.integers(1, 80), t2=st.integers(1, 50), steps=st.lists(st.integers(1, 20), min_size=1, max_size=3))
def test_hybrid_lm_prefill_then_decode_equals_full_forward(pattern, t1, t2, steps):
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=2, n_heads=HEADS, pattern=pattern, window=24,
                       chunk_size=16, n_bswa_chunks=2, qk_conv=2, backend="dense",
                       mixer_options={"ovq": {"max_centroids": 20}, "vq": {"codebook_size": 12},
                                      "longvq": {"codebook_size": 12}})
    torch.manual_seed(t1 + 100 * t2)
    model = _perturbed(HybridLM(cfg))
    tokens = _tokens_without_repeated_pairs(2, t1 + t2, 40)
    with torch.no_grad():
        full = model(tokens)
        streamed, cache = _stream(model, tokens, t1, steps)
    assert cache.position == t1 + t2
    assert_close(streamed, full, FWD_TOL[torch.float32], f"{pattern} t1={t1} t2={t2}")


def test_generate_greedy_matches_argmax_of_full_forward():
    """Greedy generation through the caches picks, at every step, the argmax of a full
    forward over everything so far (no cache involved)."""
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=2, n_heads=HEADS, pattern="swa,ovq", window=24,
                       chunk_size=16, backend="dense",
                       mixer_options={"ovq": {"max_centroids": 20}})
    model = _perturbed(HybridLM(cfg))
    prompt = torch.randint(0, 40, (2, 21))
    out = model.generate(prompt, 30, temperature=0)
    assert out.shape == (2, 51) and torch.equal(out[:, :21], prompt)
    with torch.no_grad():
        logits = model(out[:, :-1])
    assert torch.equal(logits[:, 20:].argmax(-1), out[:, 21:])


def test_generate_samples_reproducibly_within_top_k():
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=1, n_heads=HEADS, pattern="kvm", chunk_size=16,
                       backend="dense")
    model = _perturbed(HybridLM(cfg))
    prompt = torch.randint(0, 40, (3, 5))
    a = model.generate(prompt, 40, temperature=1.5, top_k=3, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 40, temperature=1.5, top_k=3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    with torch.no_grad():
        logits = model(a[:, :-1])[:, 4:]
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[:, 5:, None]).any(-1).all(), "a sampled token outside the top 3"


@pytest.mark.parametrize("temperature, top_k", [(0.7, 3), (1.0, None), (2.0, 5), (1.0, 7)],
                         ids=["t0.7-top3", "t1", "t2-top5", "t1-top7"])
def test_samples_follow_the_softmax_at_the_temperature_over_the_top_k(temperature, top_k):
    """``sample_next`` draws from ``softmax(logits / temperature)`` renormalised over the ``top_k`` best
    tokens: 40,000 draws of one row (seeded) are within 0.012 of each token's probability (at least 4.8
    standard deviations of a frequency; these draws are within 0.0046), and no token past the k-th is drawn
    (the 4th token's logit is 0.1 below the 3rd's)."""
    from ovqflex.models.hybrid import sample_next

    logits = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    draws = sample_next(logits.expand(n, -1), temperature, top_k, generator=torch.Generator().manual_seed(3))
    assert draws.shape == (n, 1) and draws.dtype == torch.int64
    freq = torch.bincount(draws.flatten(), minlength=len(logits)).double() / n
    kept = len(logits) if top_k is None else top_k  # the logits are sorted: the top k are the first k
    want = torch.zeros(len(logits), dtype=torch.float64)
    want[:kept] = torch.softmax(logits[:kept].double() / temperature, dim=0)
    assert (freq - want).abs().max() < 0.012, (freq, want)
    assert freq[kept:].sum() == 0


def test_sampling_at_a_tiny_temperature_is_greedy_and_an_infinite_one_is_refused():
    """logits / temperature overflowed for a temperature near 0 (softmax of inf: NaN, and torch.multinomial
    refused the probabilities); an infinite temperature made every logit 0, so top_k kept every token."""
    from ovqflex.models.hybrid import sample_next

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for top_k in (None, 3):
        assert torch.equal(sample_next(logits, 1e-40, top_k), logits.argmax(-1, keepdim=True))
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=1, n_heads=HEADS, pattern="swa", backend="dense")
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=f"temperature must be a finite number >= 0, got {bad!r}"):
            HybridLM(cfg).generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=bad)
    for top_k, error, match in ((0, ValueError, "top_k must be >= 1, got 0"),
                                (2.5, TypeError, "top_k must be an int, got float 2.5")):
        with pytest.raises(error, match=match):
            HybridLM(cfg).generate(torch.zeros(1, 3, dtype=torch.long), 2, top_k=top_k)


@pytest.mark.parametrize("training", [True, False], ids=["train-mode", "eval-mode"])
def test_generate_runs_the_model_in_eval_mode_and_gives_its_mode_back(training):
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=2, n_heads=HEADS, pattern="swa,vq", chunk_size=16,
                       backend="dense")
    model = HybridLM(cfg).train(training)
    modes = []
    model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    model.generate(torch.zeros(1, 3, dtype=torch.long), 4)
    assert modes == [False] * 4 and model.training == training


@pytest.mark.parametrize("decode", ["functional", "static"])
def test_generate_runs_one_prefill_then_a_step_per_new_token_but_the_last(decode):
    """Each new token is sampled from the logits before it: n tokens take the prefill and n - 1
    decode steps (the last token is not run through the layers)."""
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=1, n_heads=HEADS, pattern="swa", backend="dense")
    model = HybridLM(cfg)
    calls = []
    model.embed.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 5, decode=decode)
    assert out.shape == (2, 8) and calls == [3, 1, 1, 1, 1]


def test_generate_restores_training_mode():
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=1, n_heads=HEADS, pattern="swa", backend="dense")
    model = HybridLM(cfg).train()
    model.generate(torch.zeros(1, 3, dtype=torch.long), 2)
    assert model.training


@pytest.mark.parametrize("threads", [1, 2])
@given(T=st.integers(1, 700), chunk=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_ovq_prefill_holds_the_dictionary_routing_built_bit_for_bit(threads, T, chunk, seed):
    """The prefill absorbs all complete chunks in one scatter-add; routing absorbed them one chunk
    after another: the sums and counts must be equal bit for bit (decode routes against them)."""
    from ovqflex.ops.ovq import OVQOptions
    from ovqflex.ops.ovq_decode import ovq_prefill
    from recurrences.ovq import route_ovq
    from recurrences.ovq.routing import ovq_absorb

    g = torch.Generator().manual_seed(seed)
    kn = torch.nn.functional.normalize(torch.randn(2, 3, T, 8, generator=g), dim=-1)
    v = 100 * torch.randn(2, 3, T, 5, generator=g)  # large values: a different order of adds shows
    opts = OVQOptions(chunk_size=chunk, max_centroids=24)
    routes = route_ovq(kn, schedule=opts.schedule)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = ovq_prefill(kn, v, routes, opts, None)
    finally:
        torch.set_num_threads(before)
    rows = cache.key_sums.shape[2]
    sums, vsums, counts = torch.zeros(2, 3, rows, 8), torch.zeros(2, 3, rows, 5), torch.zeros(2, 3, rows)
    for c in range(T // chunk):  # routing's own order: one chunk after another
        sl = slice(c * chunk, (c + 1) * chunk)
        ovq_absorb(sums, counts, kn[:, :, sl], routes[:, :, sl], vsums, v[:, :, sl])
    assert torch.equal(cache.key_sums, sums) and torch.equal(cache.value_sums, vsums)
    assert torch.equal(cache.counts, counts)


def test_ovq_cache_with_a_huge_cap_allocates_what_the_tokens_can_fill():
    """max_centroids 10**9 (128 GB if allocated at the cap): the dictionary holds at most one row
    per token seen, so the cache allocates by need (doubling) and stays small."""
    layer = LAYERS["ovq-huge-cap"]().eval()
    x = torch.randn(1, 200, HIDDEN)
    with torch.no_grad():
        _, cache = layer(x[:, :40], use_cache=True)
        assert cache.max_centroids == 10**9 and cache.rows <= 40
        for i in range(40, 200):
            _, cache = layer(x[:, i:i + 1], cache=cache)
            assert cache.rows <= 2 * (i + 1), f"{cache.rows} rows allocated after {i + 1} tokens"
    n_rows = int((cache.counts > 0).sum(-1).max())
    assert 150 <= n_rows <= cache.rows <= 2 * 200 and cache.nbytes() < 200_000


def test_ovq_cache_stops_growing_over_20000_decoded_tokens():
    """max_centroids 256: the dictionary grows to its bound and no further; the raw-token
    buffer never reaches a chunk. The bound is computed here from the documented formula: the
    dictionary's sums and counts, its read form (mean keys, mean values, bias of at most N rows)
    and the buffer."""
    B, H, D, C, N = 1, 1, 16, 32, 256
    layer = ovqflex.OVQAttention(H * D, H, chunk_size=C, max_centroids=N, backend="dense").eval()
    x = torch.randn(B, 20001, H * D)
    bound = B * H * ((N + 1) * (2 * D + 1) * 4 + N * (2 * D + 1) * 4 + (C - 1) * 2 * D * 4)
    sizes, stored = [], []  # all bytes; the bytes without the read form, which follows N_c <= N
    with torch.no_grad():
        _, cache = layer(x[:, :1], use_cache=True)
        for i in range(1, x.shape[1]):
            _, cache = layer(x[:, i:i + 1], cache=cache)
            sizes.append(cache.nbytes())
            stored.append(sizes[-1] - sum(t.numel() * t.element_size() for t in (cache.view or ())[:3]))
    assert isinstance(cache, OVQCache) and cache.position == 20001
    assert max(sizes) <= bound
    assert max(stored[10000:]) == max(stored[1000:10000]), "the cache kept growing after saturation"
    assert cache.view.keys.shape[2] <= N
    live = int((cache.counts[..., :N] > 0).sum())
    assert 240 <= live <= N, f"dictionary rows in use: {live}"


def test_window_caches_are_bounded_and_full_attention_grows():
    x = torch.randn(1, 300, HIDDEN)
    swa, bswa, full = LAYERS["swa-20-sinks"](), LAYERS["bswa-2x16"](), LAYERS["full-rope-conv"]()
    with torch.no_grad():
        kept = {}
        for name, layer in (("swa", swa), ("bswa", bswa), ("full", full)):
            _, cache = layer(x[:, :10], use_cache=True)
            n = []
            for i in range(10, 300):
                _, cache = layer(x[:, i:i + 1], cache=cache)
                n.append(cache.k.shape[2])
            kept[name] = n
    assert max(kept["swa"]) == 19 + 2  # window - 1 tokens and 2 sinks
    assert max(kept["bswa"]) <= 2 * 16
    assert kept["full"][-1] == 300


def test_vq_cache_holds_code_statistics_and_at_most_two_chunks():
    layer = _perturbed(LAYERS["longvq"]())
    x = torch.randn(1, 300, HIDDEN)
    with torch.no_grad():
        _, cache = layer(x[:, :3], use_cache=True)
        for i in range(3, 300, 5):
            _, cache = layer(x[:, i:i + 5], cache=cache)
            assert cache.win_k.shape[2] <= 2 * 16 and cache.counts.shape == (1, HEADS, 12)
            # every token is either counted in the state (once per head) or still in the window
            assert int(cache.counts.sum()) == HEADS * (cache.position - cache.win_k.shape[2])


def test_kvm_cache_holds_state_and_at_most_nb_chunks():
    """A capped KVM cache holds at most ``Nb`` window chunks and its cap's state rows, allocated at once when
    the state is founded (one size from then on, not re-grown as the budget's rows grow)."""
    layer = _perturbed(LAYERS["kvm-saturation-nb3-means"]())
    x = torch.randn(1, 400, HIDDEN)
    with torch.no_grad():
        _, cache = layer(x[:, :3], use_cache=True)
        for i in range(3, 400, 7):
            _, cache = layer(x[:, i:i + 7], cache=cache)
            assert isinstance(cache, KVMCache)
            assert cache.win_k.shape[2] <= 3 * 16
            assert cache.state.shape[2] == (3 * 16 if cache.position > 3 * 16 else 0) and cache.rows <= 3 * 16


def test_recurrent_caches_stay_constant_over_2000_decoded_tokens():
    """The caches of linear attention, DeltaNet and VLA hold the state only: their size is the
    documented bound (computed here from the formula) after the prefill and at every step."""
    B, H, D, K = 1, 2, 16, 3
    S, z, A, conv = H * D * D * 4, H * D * 4, H * D * D * 4, 2 * H * D * (K - 1) * 4
    cases = [(ovqflex.LinearAttention(H * D, H, chunk_size=16, qk_conv=K), LinearAttentionCache, B * (S + z) + conv),
             (ovqflex.DeltaNetAttention(H * D, H, chunk_size=16, qk_conv=K), DeltaNetCache, B * S + conv),
             (ovqflex.VLAAttention(H * D, H, qk_conv=K), VLACache, B * (S + A + z) + conv)]
    x = torch.randn(B, 2001, H * D)
    for layer, kind, bound in cases:
        layer = _perturbed(layer)
        with torch.no_grad():
            _, cache = layer(x[:, :37], use_cache=True)
            sizes = [cache.nbytes()]
            for i in range(37, x.shape[1]):
                _, cache = layer(x[:, i:i + 1], cache=cache)
                sizes.append(cache.nbytes())
        name = type(layer).__name__
        assert isinstance(cache, kind) and cache.position == x.shape[1], name
        assert set(sizes) == {bound}, f"{name}: cache sizes {sorted(set(sizes))}, bound {bound}"
        assert all(torch.isfinite(t).all() for t in cache.tensors()), name
        assert not any(t.requires_grad for t in cache.tensors()), name


def test_a_cache_counts_the_bytes_of_its_tensors_at_their_dtypes():
    """``nbytes``: each tensor's elements times its element size, worked by hand: fp32 keys ``[1, 2, 3, 16]``
    (384 bytes), bf16 values ``[1, 2, 3, 8]`` (96), int64 positions ``[3]`` (24)."""
    cache = PlainCache(position=3, conv=None, k=torch.zeros(1, 2, 3, 16),
                       v=torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), pos=torch.arange(3))
    assert cache.nbytes() == 384 + 96 + 24


@pytest.mark.parametrize("name", list(LAYERS))
def test_caches_hold_no_graph(name):
    """Even when the layer runs with gradients, its cache holds detached tensors (conv tails included)."""
    layer = LAYERS[name]().eval()
    x = torch.randn(1, 40, HIDDEN, requires_grad=True)
    y, cache = layer(x, use_cache=True)
    assert y.requires_grad and not any(t.requires_grad for t in cache.tensors())
    y, cache = layer(x[:, :2], cache=cache)
    assert y.requires_grad and not any(t.requires_grad for t in cache.tensors())


def test_recurrent_layers_decode_zero_tokens():
    for name in ("linear-outnorm-conv", "deltanet-outnorm-conv", "vla-outnorm-conv-r12c4"):
        layer = _perturbed(LAYERS[name]())
        x = torch.randn(2, 30, HIDDEN)
        with torch.no_grad():
            full = layer(x)
            y0, cache = layer(x[:, :13], use_cache=True)
            empty, cache2 = layer(x[:, :0], cache=cache)
            y1, cache3 = layer(x[:, 13:], cache=cache2)
        assert empty.shape == (2, 0, HIDDEN) and cache2 is not cache and cache2.position == 13, name
        assert cache3.position == 30, name
        assert_close(torch.cat([y0, y1], 1), full, FWD_TOL[torch.float32], name)


class NoCache(MultiHeadProjection):
    """A mixer without a decode cache (no ``cache_type``): y = o_proj(v)."""

    def __init__(self, hidden_size, num_heads):
        super().__init__(hidden_size, num_heads, None, None)

    def _full(self, inputs):
        return inputs[2], {}


def test_bad_cache_arguments_are_refused(monkeypatch):
    ovq, swa = LAYERS["ovq-plateau"](), LAYERS["swa-20-sinks"]()
    lin, vla = LAYERS["linear"](), LAYERS["vla"]()
    x = torch.randn(1, 20, HIDDEN)
    with torch.no_grad():
        _, swa_cache = swa(x, use_cache=True)
        _, ovq_cache = ovq(x, use_cache=True)
        _, lin_cache = lin(x, use_cache=True)
        with pytest.raises(TypeError, match="cache for OVQAttention must be a OVQCache"):
            ovq(x, cache=swa_cache)
        with pytest.raises(ValueError, match=r"max_centroids=99 differs from the cache's 24; start a new cache "
                                             r"\(prefill\) to change it"):
            ovq(x, cache=ovq_cache, max_centroids=99)
        with pytest.raises(TypeError, match="cache for VLAAttention must be a VLACache"):
            vla(x, cache=lin_cache)
        with pytest.raises(ValueError, match=r"initial_state.S must have shape \(1, 2, 16, 16\)"):
            LAYERS["linear"]()(torch.randn(1, 3, HIDDEN), cache=LinearAttentionCache(
                position=20, conv=None, state=torch.zeros(1, 2, 8, 16), key_sum=torch.zeros(1, 2, 16)))
        _, vla_cache = vla(x, use_cache=True)
        with pytest.raises(ValueError, match="VLA state is at position 20, the cache at 21"):
            VLACache.of(vla_cache.recurrence_state(), 21, None)  # its refresh schedule would be off by one
    # every mixer of the registry decodes now (linear recurrences included) ...
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=2, n_heads=HEADS, pattern="linear,vla")
    assert HybridLM(cfg).generate(torch.zeros(1, 3, dtype=torch.long), 2).shape == (1, 5)
    # ... and one without a cache is still refused with its name
    monkeypatch.setitem(METHODS, "nocache", Method("nocache", NoCache, "a mixer without a decode cache",
                                                   from_config=lambda c: {}))
    cfg = HybridConfig(vocab_size=40, d_model=HIDDEN, n_layers=1, n_heads=HEADS, pattern="nocache")
    with pytest.raises(NotImplementedError, match="mixer 'nocache'"):
        HybridLM(cfg).generate(torch.zeros(1, 3, dtype=torch.long), 2)
    assert isinstance(swa_cache, PlainCache)
