"""Plain layers: equal SDPA with an explicit mask; compile with fullgraph (docs/design.md §4.1, §9.7)."""
import math

import pytest
import torch
from torch._dynamo.utils import counters

import ovqflex
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close, assert_compiled_training_matches_eager
from tests.ovqflex.test_attention import explicit_mask

LAYERS = {
    "causal-nope": (lambda: ovqflex.CausalAttention(48, 3), {}),
    "causal-rope": (lambda: ovqflex.CausalAttention(48, 3, rope=True), {}),
    "swa-40": (lambda: ovqflex.SlidingWindowAttention(48, 3, window=40), {"window": 40}),
    "swa-40-sinks2": (lambda: ovqflex.SlidingWindowAttention(48, 3, window=40, n_sinks=2), {"window": 40, "n_sinks": 2}),
    "bswa-2x32": (lambda: ovqflex.SlidingWindowAttention(48, 3, block_window=2, chunk_size=32),
                  {"block_window": 2, "chunk_size": 32}),
}


def reference_forward(layer, x, mask_kw):
    q, k, v, _ = layer._project(x, None)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=explicit_mask(x.shape[1], **mask_kw))
    return layer.merge(o)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_equals_sdpa_with_explicit_mask(name):
    make, mask_kw = LAYERS[name]
    layer = make()
    x = torch.randn(2, 150, 48, requires_grad=True)
    ref = reference_forward(layer, x, mask_kw)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    layer.backend = "blocked"
    y = layer(x)
    assert y.shape == x.shape
    assert_close(y, ref, FWD_TOL[torch.float32], "blocked forward")
    y.square().sum().backward()
    for i, (a, b) in enumerate(zip([x.grad] + [p.grad for p in layer.parameters()], ref_grads)):
        assert_close(a, b, GRAD_TOL[torch.float32], f"grad {i}")
    layer.backend = "flex"
    with torch.no_grad():
        assert_close(layer(x), ref, FWD_TOL[torch.float32], "flex forward")


@pytest.mark.parametrize("qk_norm", [False, True], ids=["scaled-dot", "qk-norm"])
def test_the_projections_written_out(qk_norm):
    """The layer against its definition, the projections included (the reference above takes them from the
    layer): q, k, v are rows of the fused weight, head-major; with ``qk_norm`` q and k are unit per head and a
    logit is ``beta[h] <q, k>``, else ``<q, k> / sqrt(D)``; RoPE at the layer's base (500 here) is a complex
    rotation of the half-split pairs."""
    from tests.ovqflex.layers.test_rope import rope_complex

    torch.manual_seed(0)
    B, T, H, D = 2, 40, 3, 16
    layer = ovqflex.SlidingWindowAttention(H * D, H, window=12, rope_base=500.0, qk_norm=qk_norm, backend="blocked")
    x = torch.randn(B, T, H * D)
    with torch.no_grad():
        if qk_norm:
            layer.beta.uniform_(2.0, 6.0)
        q, k, v = (x @ layer.qkv_proj.weight.T).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        scale = D**-0.5
        if qk_norm:
            q = q / q.norm(dim=-1, keepdim=True) * layer.beta.view(1, H, 1, 1)
            k, scale = k / k.norm(dim=-1, keepdim=True), 1.0
        pos = torch.arange(T)
        q, k = (rope_complex(t, pos, D, 500.0, False).float() for t in (q, k))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=explicit_mask(T, window=12),
                                                             scale=scale)
        ref = o.transpose(1, 2).reshape(B, T, H * D) @ layer.o_proj.weight.T
        assert_close(layer(x), ref, FWD_TOL[torch.float32], "layer")


def test_a_window_set_on_a_built_layer_replaces_the_other_kind_and_reads_back():
    """Setting ``window`` drops a block window and the other way round; each reads back, and the regions are
    those of a layer built with the same settings."""
    def built(**shape):
        return ovqflex.SlidingWindowAttention(32, 2, chunk_size=16, **shape).regions

    layer = ovqflex.SlidingWindowAttention(32, 2, block_window=2, chunk_size=16)
    layer.window = 8
    assert (layer.window, layer.block_window, layer.regions) == (8, None, built(window=8))
    layer.block_window = 3
    assert (layer.window, layer.block_window, layer.regions) == (None, 3, built(block_window=3))
    layer.n_sinks = 2
    assert (layer.n_sinks, layer.regions) == (2, built(block_window=3, n_sinks=2))


@pytest.mark.parametrize("backend, dtype", [("blocked", torch.float32), ("flex", torch.float32),
                                            ("blocked", torch.float64)], ids=["blocked", "flex", "blocked-fp64"])
def test_logn_len_multiplies_each_querys_logits_by_its_log_length(backend, dtype):
    """The reference scales the logits of the unscaled layer's q, k row by row with ln(t + 1) /
    ln(L) from the math module, masks with the explicit causal mask, and runs softmax by hand. A float64
    layer scales in float64 (its scale had been fp32: 6e-8 off)."""
    torch.manual_seed(0)
    T, L = 150, 24
    layer = ovqflex.CausalAttention(48, 3, qk_norm=True, qk_conv=3, backend=backend).to(dtype)
    x = torch.randn(2, T, 48, dtype=dtype)
    with torch.no_grad():
        layer.beta.uniform_(4.0, 12.0)
        q, k, v, _ = layer._project(x, None)
        plain = layer(x)
        row_scale = torch.tensor([max(1.0, math.log(t + 1) / math.log(L)) for t in range(T)], dtype=dtype)
        scores = (q @ k.transpose(-1, -2)) * row_scale.view(T, 1)
        weights = scores.masked_fill(~explicit_mask(T), float("-inf")).softmax(-1)
        ref = layer.merge(weights @ v)
        layer.logn_len = L
        scaled = layer(x)
    assert_close(scaled, ref, FWD_TOL[dtype], f"{backend} with logn_len={L}")
    assert torch.equal(scaled[:, :L], plain[:, :L])  # up to L keys nothing changes
    assert (scaled[:, L + 1:] - plain[:, L + 1:]).abs().amax() > 1e-3
    assert "logn_len=24" in repr(layer)


def test_compiled_layer_forward_flex_no_graph_break():
    counters.clear()
    layer = ovqflex.SlidingWindowAttention(64, 4, window=100, n_sinks=2)
    x = torch.randn(2, 200, 64)
    with torch.no_grad():
        ref = layer(x)
        compiled = torch.compile(layer, fullgraph=True)
        assert_close(compiled(x), ref, FWD_TOL[torch.float32], "compiled flex")
        graphs = counters["stats"]["unique_graphs"]
        compiled(torch.randn(2, 200, 64))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for a second equal-shape call


def test_compiled_training_step_blocked():
    torch.manual_seed(0)
    layer = ovqflex.CausalAttention(64, 4, rope=True, backend="blocked")
    eager = ovqflex.CausalAttention(64, 4, rope=True, backend="blocked")
    eager.load_state_dict(layer.state_dict())
    assert_compiled_training_matches_eager(layer, eager, torch.randn(2, 130, 64))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ovqflex.SlidingWindowAttention(32, 2, window=0), "window"),
        (lambda: ovqflex.SlidingWindowAttention(32, 2, block_window=2, chunk_size=100), "chunk_size"),
        (lambda: ovqflex.CausalAttention(32, 0), "num_heads"),
        (lambda: ovqflex.CausalAttention(32, 2, backend="fast"), "backend"),
        (lambda: ovqflex.CausalAttention(30, 2, head_dim=15, rope=True), "even"),
        (lambda: ovqflex.SlidingWindowAttention(32, 2, window=None), "needs window=N .*use CausalAttention"),
        (lambda: ovqflex.SlidingWindowAttention(32, 2, window=64, block_window=2),
         r"give window or block_window, not both \(window=64, block_window=2\)"),
        (lambda: ovqflex.CausalAttention(32, 2, block_size=0), "block_size must be a power of two >= 16"),
        (lambda: ovqflex.CausalAttention(32, 2, logn_len=1), "logn_len must be 0 \\(off\\) or an int >= 2"),
        (lambda: ovqflex.CausalAttention(32, 2, logn_len=-3), "logn_len must be >= 0, got -3"),
        (lambda: ovqflex.CausalAttention(32, 2, logn_len=2048.0), "logn_len must be an int, got float"),
    ],
    ids=["window-0", "chunk-100", "heads-0", "backend", "odd-rope", "no-window", "both-windows", "block-0", "logn-1",
         "logn-neg", "logn-float"],
)
def test_bad_layer_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_a_block_window_replaces_a_default_window_and_is_refused_beside_one_given():
    """The layer's default window (512), the swa and sinks methods' (128) and a model config's are defaults: a
    block window replaces them. A window given with a block window is refused, where the block window had
    replaced it silently."""
    from ovqflex.methods import METHODS
    from ovqflex.models import HybridConfig, HybridLM

    bswa = dict(block_window=2, chunk_size=16)
    assert ovqflex.SlidingWindowAttention(32, 2).window == 512
    assert (ovqflex.SlidingWindowAttention(32, 2, **bswa).window, METHODS["swa"].example(2, 16, bswa).window) == \
        (None, None)
    sinks = METHODS["sinks"].example(2, 16, bswa)
    assert (sinks.window, sinks.block_window, sinks.n_sinks) == (None, 2, 4)
    cfg = dict(vocab_size=40, d_model=32, n_layers=1, n_heads=2, pattern="swa", chunk_size=16)
    mixer = HybridLM(HybridConfig(**cfg, mixer_options={"swa": {"block_window": 2}})).blocks[0].mixer
    assert (mixer.window, mixer.block_window) == (None, 2)
    for make in (lambda: METHODS["swa"].example(2, 16, dict(bswa, window=64)),
                 lambda: HybridLM(HybridConfig(**cfg, mixer_options={"swa": {"block_window": 2, "window": 8}}))):
        with pytest.raises(ValueError, match="give window or block_window, not both"):
            make()


@pytest.mark.parametrize("x, match", [(torch.randn(2, 10), "3 dims"), (torch.randn(1, 10, 31), "hidden_size")],
                         ids=["rank", "width"])
def test_bad_layer_input(x, match):
    with pytest.raises(ValueError, match=match):
        ovqflex.CausalAttention(32, 2)(x)
