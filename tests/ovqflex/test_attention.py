"""flex == blocked == dense on plain programs (docs/design.md §3.4, §9.2)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ovqflex
from masks.program import build_program
from masks.regions import StateBank
from ovqflex.attention import flex_block_size
from ovqflex.models import PRESETS, preset
from ovqflex.ops.plain import plain_regions
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close

# flex compiles one graph per (shape, region structure): keep to a few buckets
FLEX_SHAPES = [(1, 1, 16), (2, 3, 32), (1, 2, 64)]


@st.composite
def plain_cases(draw, shapes=None):
    B, H, D = draw(st.sampled_from(shapes)) if shapes else (
        draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.sampled_from([16, 24, 32, 48, 64])))
    T = draw(st.integers(1, 256))
    kind = draw(st.sampled_from(["full", "window", "bswa"]))
    kw = {"n_sinks": draw(st.sampled_from([0, 0, 1, 4]))}
    if kind == "window":
        kw["window"] = draw(st.integers(1, 300))
    elif kind == "bswa":
        kw["block_window"] = draw(st.integers(1, 3))
        kw["chunk_size"] = draw(st.sampled_from([16, 32, 64, 128]))
    seed = draw(st.integers(0, 2**16))
    return B, H, D, T, kw, seed


def make_qkv(B, H, D, T, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def program(q, k, v, kw):
    return build_program(q, k, v, plain_regions(**kw), scale=q.shape[-1] ** -0.5)


# each example of a flex property compiles a graph (~4.5 s cold on two cores): half the profile's examples
FLEX_EXAMPLES = settings(max_examples=max(1, settings.default.max_examples // 2))


@FLEX_EXAMPLES
@given(plain_cases(FLEX_SHAPES))
def test_flex_equals_blocked_equals_dense(case):
    B, H, D, T, kw, seed = case
    q, k, v = make_qkv(B, H, D, T, seed)
    p = program(q, k, v, kw)
    dense = ovqflex.attend(p, "dense")
    assert dense.shape == (B, H, T, D)
    assert_close(ovqflex.attend(p, "blocked"), dense, FWD_TOL[torch.float32], "blocked vs dense")
    with torch.no_grad():
        assert_close(ovqflex.attend(p, "flex"), dense, FWD_TOL[torch.float32], "flex vs dense")


@given(plain_cases())
def test_blocked_gradients_equal_dense(case):
    B, H, D, T, kw, seed = case
    grads = {}
    for backend in ("blocked", "dense"):
        q, k, v = make_qkv(B, H, D, T, seed, requires_grad=True)
        out = ovqflex.attend(program(q, k, v, kw), backend)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
        (out * w).sum().backward()
        grads[backend] = (out.detach(), q.grad, k.grad, v.grad)
    for name, a, b in zip("oqkv", grads["blocked"], grads["dense"]):
        assert_close(a, b, GRAD_TOL[torch.float32], f"d{name}")


def explicit_mask(T, window=None, block_window=None, chunk_size=128, n_sinks=0):
    """Plain-Python bool mask [T, T] from the definitions of docs/design.md §4.1."""
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            if window is not None:
                ok = i - j < window
            elif block_window is not None:
                ok = j // chunk_size > i // chunk_size - block_window
            else:
                ok = True
            m[i, j] = ok or j < n_sinks
    return m


@pytest.mark.parametrize("kw", [{}, {"window": 7}, {"window": 64, "n_sinks": 2}, {"block_window": 2, "chunk_size": 16},
                                {"block_window": 1, "chunk_size": 32, "n_sinks": 1}],
                         ids=["full", "window7", "window64-sinks2", "bswa2x16", "own32-sink1"])
def test_plain_program_equals_sdpa_with_explicit_mask(kw):
    q, k, v = make_qkv(2, 2, 32, 150, seed=3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=explicit_mask(150, **kw))
    for backend in ("dense", "blocked"):
        assert_close(ovqflex.attend(program(q, k, v, kw), backend), ref, FWD_TOL[torch.float32], backend)


def test_causal_flex_equals_sdpa_at_block_multiple():
    q, k, v = make_qkv(1, 2, 32, 256, seed=5)
    with torch.no_grad():
        out = ovqflex.causal_attention(q, k, v, backend="flex")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, ref, FWD_TOL[torch.float32], "flex causal")


def test_flex_refuses_backward_on_cpu_and_auto_picks_blocked():
    q, k, v = make_qkv(1, 1, 16, 40, seed=1, requires_grad=True)
    p = program(q, k, v, {})
    with pytest.raises(NotImplementedError, match=r"flex attention has no backward on cpu in this torch; use "
                                                  r"backend='blocked' \(or 'auto'\)"):
        ovqflex.attend(p, "flex")
    assert ovqflex.resolve_backend("auto", p) == "blocked"
    with torch.no_grad():
        assert ovqflex.resolve_backend("auto", p) == "flex"


def test_bf16_inputs_match_fp32():
    q, k, v = make_qkv(1, 2, 32, 100, seed=2)
    ref = ovqflex.attend(program(q, k, v, {"window": 30}), "dense")
    out = ovqflex.attend(program(q.bfloat16(), k.bfloat16(), v.bfloat16(), {"window": 30}), "blocked")
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, FWD_TOL[torch.bfloat16], "bf16 blocked")


@pytest.mark.parametrize("backend", ["blocked", "dense"])
def test_eager_backends_compute_a_bf16_program_in_fp32_under_autocast_too(backend):
    """The scores and the weighted sum of a bf16 program are fp32, as flex's are: the output is the
    fp32 program's of the same values, rounded once, with or without autocast (which would run the
    matmuls in bf16: scores rounded to bf16 before the softmax)."""
    q, k, v = (t.bfloat16() for t in make_qkv(1, 2, 32, 100, seed=3))
    want = ovqflex.attend(program(q.float(), k.float(), v.float(), {"window": 30}), backend).to(torch.bfloat16)
    assert torch.equal(ovqflex.attend(program(q, k, v, {"window": 30}), backend), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ovqflex.attend(program(q, k, v, {"window": 30}), backend), want)


def _softmax_attention_f64(q, k, v, mask, scale):
    """softmax(q k^T scale, masked) v, by hand in float64: the oracle of a float64 program."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()


@pytest.mark.parametrize("backend", ["blocked", "dense", "auto"])
def test_a_float64_program_is_computed_in_float64(backend):
    """The eager backends compute a float64 program in float64 (scores, softmax, weighted sum): fp32
    scores would leave an error of ~1e-7; ``auto`` takes ``blocked`` for it, with and without a grad."""
    q, k, v = (t.double() for t in make_qkv(2, 2, 16, 100, seed=4))
    want = _softmax_attention_f64(q, k, v, explicit_mask(100, window=30), 16**-0.5)
    with torch.no_grad():
        out = ovqflex.attend(program(q, k, v, {"window": 30}), backend)
    assert out.dtype == torch.float64
    assert_close(out, want, 1e-13, backend)


def test_auto_takes_blocked_for_a_float64_program_and_flex_refuses_it_on_cpu():
    """torch's CPU flex kernel takes fp32, bf16 and fp16 programs only: a float64 one is refused by
    name (it used to fail deep in inductor's lowering), and ``auto`` never gives it one."""
    q, k, v = (t.double() for t in make_qkv(1, 1, 16, 40, seed=1, requires_grad=True))
    p = program(q, k, v, {})
    assert ovqflex.resolve_backend("auto", p) == "blocked"
    with torch.no_grad():
        assert ovqflex.resolve_backend("auto", p) == "blocked"
        with pytest.raises(ValueError, match=r"backend='flex' on cpu takes .*got torch.float64"):
            ovqflex.attend(p, "flex")
        p32 = program(*(t.float() for t in (q, k, v)), {})
        assert ovqflex.resolve_backend("auto", p32) == "flex"


def test_attend_rows_computes_a_float64_query_in_float64():
    from ovqflex.attention import attend_rows

    q, k, v, visible, bias = (t.double() if t.is_floating_point() else t for t in _rows_case(None))
    s = (q @ k.transpose(-1, -2)) * 0.3 + bias[:, :, None, :]
    want = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v
    out = attend_rows(q, k, v, visible, scale=0.3, bias=bias)
    assert out.dtype == torch.float64
    assert_close(out, want, 1e-13, "attend_rows")


def test_attend_rows_computes_in_fp32_under_autocast_too():
    """A decode step's attention over explicit rows is the same with autocast on as off."""
    from ovqflex.attention import attend_rows

    q, k, v, visible, bias = (t.bfloat16() if t.is_floating_point() else t for t in _rows_case(None))
    want = attend_rows(q, k, v, visible, scale=0.3, bias=bias.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attend_rows(q, k, v, visible, scale=0.3, bias=bias.float()), want)


@pytest.mark.parametrize(
    "args, match",
    [
        (lambda q, k, v: (q[0], k, v), "q must have 4 dims"),
        (lambda q, k, v: (q, k[:, :1], v), r"\[B, H\]"),
        (lambda q, k, v: (q, k[..., :8], v), "head dim"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "same length"),
        (lambda q, k, v: (q.long(), k, v), "floating"),
        (lambda q, k, v: (q, k.to("meta"), v), "q, k, v must be on one device; got cpu, meta, cpu"),
    ],
    ids=["rank", "heads", "head-dim", "length", "int", "device"],
)
def test_bad_inputs_raise(args, match):
    q, k, v = make_qkv(1, 2, 16, 20, seed=0)
    with pytest.raises((ValueError, TypeError), match=match):
        ovqflex.sliding_window_attention(*args(q, k, v), window=4)


@pytest.mark.parametrize(
    "kw, match",
    [({"window": 0}, "window"), ({"window": -1}, "window"), ({"block_window": 2, "chunk_size": 20}, "chunk_size"),
     ({"block_window": 2, "chunk_size": 0}, "chunk_size"), ({"window": 4, "block_window": 2}, "not both"),
     ({"window": 4, "n_sinks": -1}, "n_sinks"), ({"window": 4, "backend": "cuda"}, "backend"),
     ({"window": 4, "block_size": 100}, "block_size"),
     ({}, "needs window=N .* or block_window=N .*got neither; for full causal attention use causal_attention"),
     ({"n_sinks": 2}, "needs window=N")],
    ids=["window-0", "window-neg", "chunk-20", "chunk-0", "both", "sinks-neg", "backend", "block-100", "neither",
         "sinks-only"],
)
def test_bad_options_raise(kw, match):
    q, k, v = make_qkv(1, 1, 16, 20, seed=0)
    with pytest.raises((ValueError, TypeError), match=match):
        ovqflex.sliding_window_attention(q, k, v, **kw)


@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
def test_flex_block_size_is_the_programs_on_cpu_and_at_least_128_elsewhere(block):
    assert flex_block_size("cpu", block) == block
    assert flex_block_size("cuda", block) == max(block, 128)


def test_a_short_program_on_cuda_blocks_has_128_queries():
    """flex sends fewer than 128 queries to its decoding kernel, whose tile must divide the query
    block (the tiny preset's failure): on CUDA blocks even one query is padded to 128."""
    q, k, v = make_qkv(1, 2, 16, 1, seed=0)
    p = build_program(q, k, v, plain_regions(window=4), scale=0.25, block_size=32)
    assert p.on_blocks(flex_block_size("cuda", 32)).geom.q_pad == 128


HEAD_DIMS = sorted({16, 64, 128, 256} | {preset(n).d_model // preset(n).n_heads if preset(n).head_dim is None
                                         else preset(n).head_dim for n in PRESETS})
BLOCKS = sorted({16} | {preset(n).block_size for n in PRESETS})


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)],
                         ids=["sm80", "sm86", "sm90-h100", "sm100", "sm120"])
def test_torchs_default_cuda_flex_tiles_divide_the_cuda_block(monkeypatch, capability):
    """The forward and backward tile configs torch's CUDA heuristics pick (the installed torch's
    ``template_heuristics/triton.py``) divide the block flex gets on CUDA, for every preset's block
    size and head dim and each dtype. At the tiny preset's own 32 they do not (H100, bf16: the
    backward tiles are 64 x 128): why flex runs on 128-row blocks there."""
    heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    h = heuristics.CUDAConfigHeuristic()
    small_block_fails = False
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in HEAD_DIMS:
            tiles = [t for c in h.get_flex_attn_fwd_configs(head_dim, dtype) for t in (c.block_m, c.block_n)]
            tiles += [t for c in h.get_flex_attn_bwd_configs(head_dim, dtype)
                      for t in (c.block_m1, c.block_n1, c.block_m2, c.block_n2)]
            for block in BLOCKS:
                cuda_block = flex_block_size("cuda", block)
                assert all(cuda_block % t == 0 for t in tiles), (dtype, head_dim, block, tiles)
            small_block_fails |= any(32 % t for t in tiles)
    assert small_block_fails, "every default tile divides 32: the 128-row floor may be revisited"


def test_the_cuda_flex_path_compiles_and_runs_on_cpu_flex(monkeypatch):
    """What flex runs on CUDA, traced in one graph (program moved to 128-row blocks, captures
    through the extern identity) and run by CPU flex: an OVQ op with 32-row blocks, whose state
    rows end inside a 128-row block, equals the blocked backend."""
    import ovqflex.attention as attention

    monkeypatch.setattr(attention, "flex_block_size", lambda device_type, block: max(block, 128))
    q, k, v = make_qkv(1, 2, 32, 100, seed=5)
    beta = torch.full((2,), 5.0)
    kw = dict(chunk_size=16, max_centroids=24, block_size=32)
    from ovqflex.ops.ovq import ovq_program

    assert ovq_program(q, k, v, beta, **kw)[0].geom.n_state % 128, "the state must end inside a 128-row block"
    compiled = torch.compile(lambda q, k, v: ovqflex.ovq_attention(q, k, v, beta, backend="flex", **kw),
                             fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = compiled(q, k, v)
        ref = ovqflex.ovq_attention(q, k, v, beta, backend="blocked", **kw)
    assert_close(out, ref, FWD_TOL[torch.float32], "compiled flex on 128-row blocks")


def _poisoned(x: torch.Tensor, t: int, value: float) -> torch.Tensor:
    x = x.clone()
    x[:, :, t] = value
    return x


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("which", ["v", "k"])
@pytest.mark.parametrize("backend", ["dense", "blocked"])
@pytest.mark.parametrize("kw", [dict(window=20), dict(window=20, n_sinks=2), dict(block_window=2, chunk_size=16)],
                         ids=["window20", "window20-sinks2", "bswa2x16"])
def test_a_non_finite_token_reaches_exactly_the_queries_that_see_it(kw, backend, which, value):
    """The rule of ``ovqflex.attention``: a NaN/inf in v (or k) at t=50 (mid block: blocks of 32)
    leaves every query that does not see t bit-identical, earlier ones and those past the window
    alike; the queries that see it are NaN."""
    T, t = 128, 50
    q, k, v = make_qkv(1, 2, 16, T, seed=3)
    bad = dict(q=q, k=k, v=v) | {which: _poisoned(dict(k=k, v=v)[which], t, value)}
    clean = ovqflex.sliding_window_attention(q, k, v, backend=backend, block_size=32, **kw)
    out = ovqflex.sliding_window_attention(bad["q"], bad["k"], bad["v"], backend=backend, block_size=32, **kw)
    pos = torch.arange(T)
    if "window" in kw:
        sees = (pos >= t) & (pos < t + kw["window"])
    else:
        c = kw["chunk_size"]
        sees = (pos >= t) & (pos // c - t // c < kw["block_window"])
    assert torch.equal(out[:, :, ~sees], clean[:, :, ~sees])
    assert out[:, :, sees].isnan().all()


@pytest.mark.parametrize("backend", ["dense", "blocked"])
def test_a_masked_non_finite_value_gets_no_gradient_nan(backend):
    """Training next to a poisoned future row: the earlier queries' loss has finite gradients."""
    q, k, v = make_qkv(1, 1, 16, 64, seed=4, requires_grad=True)
    v_bad = _poisoned(v, 40, float("nan"))
    out = ovqflex.sliding_window_attention(q, k, v_bad, window=8, backend=backend, block_size=32)
    out[:, :, :40].sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_a_query_that_sees_no_row_gets_zeros_and_zero_gradients_on_every_backend():
    """A program of state rows alone (no token region), whose first chunk's snapshot is empty: its 16 queries see
    no kv row. They get zeros (flex's convention for such a row), with zero, finite gradients; the second chunk's
    queries get the softmax over its 8 live state rows."""
    g = torch.Generator().manual_seed(5)
    q, k, v, state_k, state_v = (torch.randn(1, 1, n, 16, generator=g) for n in (32, 32, 32, 16, 16))
    regions = (StateBank(8, 16, torch.tensor([0, 8])),)
    want = torch.softmax(0.25 * q[:, :, 16:] @ state_k[:, :, 8:].transpose(-1, -2), -1) @ state_v[:, :, 8:]
    for backend in ("blocked", "dense", "flex"):
        train = backend != "flex"  # (no backward on CPU flex)
        leaves = [x.clone().requires_grad_(train) for x in (q, state_k, state_v)]
        p = build_program(leaves[0], k, v, regions, scale=0.25, state_k=leaves[1], state_v=leaves[2], block_size=16)
        out = ovqflex.attend(p, backend)
        assert torch.equal(out[:, :, :16], torch.zeros(1, 1, 16, 16)), backend
        assert_close(out[:, :, 16:], want, FWD_TOL[torch.float32], backend)
        if train:
            grads = torch.autograd.grad(out[:, :, :16].sum(), leaves)
            assert all(torch.equal(x, torch.zeros_like(x)) for x in grads), backend


def test_eager_cpu_attention_flags_non_finite_values_only_when_there_are_some(monkeypatch):
    """The non-finite rule's pass over v (a copy of a whole KV cache per decode step) is paid on
    eager CPU only when the plain product is not finite: a clean decode step makes no flagged copy;
    a NaN in the cache makes one, and reaches the new query."""
    import ovqflex.attention as attention

    calls = []
    flag = attention._flag_nonfinite
    monkeypatch.setattr(attention, "_flag_nonfinite", lambda v: calls.append(v.shape) or flag(v))
    torch.manual_seed(0)
    layer = ovqflex.CausalAttention(32, 2, rope=True, backend="dense")
    x = torch.randn(1, 41, 32)
    with torch.no_grad():
        _, cache = layer(x[:, :40], use_cache=True)
        calls.clear()
        y, _ = layer(x[:, 40:], cache=cache)
        assert calls == [] and torch.isfinite(y).all()
        cache.v[:, :, 7] = float("nan")
        y, _ = layer(x[:, 40:], cache=cache)
    assert len(calls) == 1 and y.isnan().all()


@pytest.mark.slow
def test_flex_keeps_a_non_finite_value_out_of_earlier_query_blocks():
    """flex (compiled) is block-causal for non-finite values: query blocks before t's block are
    bit-identical to the clean run (inside listed blocks, masked NaN rows still leak on flex)."""
    T, t = 128, 50
    q, k, v = make_qkv(1, 2, 16, T, seed=3)
    with torch.no_grad():
        clean = ovqflex.sliding_window_attention(q, k, v, window=20, backend="flex", block_size=32)
        out = ovqflex.sliding_window_attention(q, k, _poisoned(v, t, float("nan")), window=20, backend="flex",
                                               block_size=32)
    assert torch.equal(out[:, :, :32], clean[:, :, :32])
    assert out[:, :, t:t + 20].isnan().all()


def _rows_case(poison: int | None):
    """q ``[2, 3, 2, 8]``, k, v ``[2, 3, 5, 8]`` (v's row ``poison`` holding a NaN), visible
    ``[2, 5]``, bias ``[2, 3, 5]``."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (2, 5, 5))
    if poison is not None:
        v[:, :, poison, 1] = float("nan")
    visible = torch.tensor([[True, True, True, True, False], [True, False, True, True, True]])
    return q, k, v, visible, torch.randn(2, 3, 5, generator=g)


@pytest.mark.parametrize("values", ["raw", "split"])
@pytest.mark.parametrize("split", [[5], [3, 2], [1, 0, 4]], ids=["one-part", "two-parts", "with-an-empty-part"])
@pytest.mark.parametrize("poison", [None, 0, 1, 4], ids=["finite", "nan-seen-by-both", "nan-seen-by-q0", "nan-seen-by-q1"])
def test_attend_rows_over_parts_equals_attend_rows_over_their_concatenation(split, poison, values):
    """A decode step reads a cached state and its newest rows as parts, never concatenated: the
    same outputs as over the concatenated rows, the non-finite rule included (a NaN value row
    reaches exactly the queries that see it) — also when the values come split already
    (``values="split"``: finite parts and row flags, as a static cache stores them)."""
    from ovqflex.attention import attend_rows, split_nonfinite

    q, k, v, visible, bias = _rows_case(poison)
    whole = attend_rows(q, k, v, visible, scale=0.3, bias=bias)
    flags = None
    if values == "split":
        v, flags = split_nonfinite(v)
    parts = attend_rows(q, k.split(split, dim=2), v.split(split, dim=2), visible, scale=0.3, bias=bias,
                        v_nonfinite=flags)
    assert torch.equal(whole.isnan(), parts.isnan())
    assert_close(parts.nan_to_num(), whole.nan_to_num(), FWD_TOL[torch.float32])
    for i in range(2):
        sees = poison is not None and bool(visible[i, poison])
        assert bool(parts[:, :, i].isnan().all()) == sees and bool(parts[:, :, i].isnan().any()) == sees


def test_compiled_attend_rows_over_split_values_keeps_the_non_finite_rule():
    """Compiled (no host check: the flagged rows' weight is always computed), values split once
    as a static cache stores them == eager attention over the raw values, with and without a NaN."""
    from ovqflex.attention import attend_rows, split_nonfinite

    step = torch.compile(lambda q, k, v, visible, bias, flags: attend_rows(q, k, v, visible, scale=0.3, bias=bias,
                                                                            v_nonfinite=flags),
                         fullgraph=True, dynamic=False)
    for poison in (None, 1):
        q, k, v, visible, bias = _rows_case(poison)
        ref = attend_rows(q, k, v, visible, scale=0.3, bias=bias)
        clean, flags = split_nonfinite(v)
        out = step(q, k, clean, visible, bias, flags)
        assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any() == (poison is not None)
        assert_close(out.nan_to_num(), ref.nan_to_num(), FWD_TOL[torch.float32])


def test_attend_rows_refuses_parts_that_do_not_pair_up():
    from ovqflex.attention import attend_rows

    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="k and v parts must have the same rows"):
        attend_rows(q, k.split([2, 3], dim=2), v.split([3, 2], dim=2), torch.ones(1, 5, dtype=torch.bool), scale=1.0)
