"""MultiHeadProjection: shapes, size checks, the optional causal q/k convolution, the heads merged."""
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import ovqflex
from ovqflex.layers import OVQAttention, SlidingWindowAttention
from ovqflex.layers.heads import MultiHeadProjection, _causal_depthwise
from tests.helpers import FWD_TOL, assert_close, assert_finite_grads_close


def test_split_heads_shapes_and_size_check():
    m = MultiHeadProjection(32, 4, None, "blocked")
    q, k, v = m.split_heads(torch.randn(2, 7, 32))
    assert q.shape == k.shape == v.shape == (2, 4, 7, 8)
    with pytest.raises(ValueError, match=r"x must have last dim hidden_size=32, got shape \(2, 7, 16\)"):
        m.split_heads(torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match="qk_conv must be >= 0"):
        MultiHeadProjection(32, 4, None, "blocked", qk_conv=-1)
    for args, name in (((0, 4, None), "hidden_size"), ((32, 0, None), "num_heads"), ((32, 4, 0), "head_dim")):
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            MultiHeadProjection(*args, "blocked")


@pytest.mark.parametrize("layer", ["OVQAttention", "KVMAttention", "VQAttention", "CausalAttention",
                                   "LinearAttention"])
def test_hidden_size_must_divide_into_heads(layer):
    """head_dim None: the heads must cover the hidden size exactly (30 = 4 x 7 + 2 would drop 2 dims)."""
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_heads=4"):
        getattr(ovqflex, layer)(30, 4)
    assert getattr(ovqflex, layer)(30, 4, head_dim=8).head_dim == 8  # an explicit head_dim may differ


@pytest.mark.parametrize("qk_conv", [0, 3], ids=["plain", "qk_conv"])
def test_q_k_and_v_keep_no_storage_in_common(qk_conv):
    """The backward keeps q and k (OVQ's and VQ's normalization reads them) or v (flex reads it beside the rotated
    q and k); as views of one buffer, the part kept held the others alive (in a compiled layer too:
    ``tools/compiled_saved.py --layer``, 64 or 128 MB per layer at 64k). With gradients recorded v's storage is v
    alone."""
    m = MultiHeadProjection(32, 4, None, "blocked", qk_conv=qk_conv)
    x = torch.randn(2, 7, 32)
    q, k, v = m.split_heads(x)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
    assert q.untyped_storage().nbytes() == 2 * q.numel() * q.element_size()
    # without gradients nothing is kept: one product (a decode step's fewest launches), the same values
    with torch.no_grad():
        one = m.split_heads(x)
    assert one[2].untyped_storage().nbytes() == 3 * v.numel() * v.element_size()
    for a, b in zip((q, k, v), one):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method, T", [("swa", 1024), ("ovq", 1024), ("vq", 1000), ("kvm", 1000)],
                         ids=["swa-rope", "ovq-scaled-queries", "vq-padded", "kvm-padded"])
def test_compiled_layer_merges_heads_from_the_flex_output(method, T):
    """Flex's output follows its query's memory order, and the layers write their queries token-major
    (masks/program.py): the compiled layer's output projection reads the buffer the flex kernel wrote, with no
    copy of the attention output between them (it was one more pass, and in training a second 64 MB kept per
    layer at 64k). Read from inductor's generated CPU code, no gradients. 1,024 tokens fill their blocks, so the
    rotary embedding or the scaled unit queries write flex's query; 1,000 are padded, and the padding writes it."""
    from torch._inductor.utils import run_and_get_code

    from ovqflex.methods import get_method

    torch.manual_seed(0)
    layer = get_method(method).example(2, 64, dict(backend="flex"))
    x = torch.randn(1, T, 128)
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(layer, fullgraph=True, dynamic=False), x)
    code = "\n".join(codes)
    flex_calls = re.findall(r"\n\s*cpp_fused\w*flex_attention\w*\(([^)]*)\)", code)
    mm_inputs = re.findall(r"extern_kernels\.mm\(reinterpret_tensor\((buf\d+),", code)
    assert len(flex_calls) == 1 and mm_inputs, "no flex kernel call or matmul found in the generated code"
    written = flex_calls[0].split(",")[-1].strip()  # the kernel's output buffer, its last argument
    assert mm_inputs[-1] == written, f"the output projection reads {mm_inputs[-1]}, flex wrote {written}"


def test_qk_conv_starts_as_identity():
    torch.manual_seed(0)
    plain = MultiHeadProjection(32, 2, None, "blocked")
    conv = MultiHeadProjection(32, 2, None, "blocked", qk_conv=3)
    conv.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 9, 32)
    for a, b in zip(plain.split_heads(x), conv.split_heads(x)):
        assert torch.equal(a, b)


@settings(max_examples=20, deadline=None)
@given(width=st.integers(1, 5), T=st.integers(1, 40), channels=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_qk_conv_is_the_depthwise_convolution(width, T, channels, seed):
    """The shifted-product sum over time-major ``[B, T, C]`` equals ``F.conv1d(groups=C)`` on the same padded
    input channels-first (fp64: the two sum their taps in their own orders)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, channels, T + width - 1, generator=g, dtype=torch.float64)
    w = torch.randn(channels, 1, width, generator=g, dtype=torch.float64)
    want = F.conv1d(x, w, groups=channels).transpose(1, 2)
    torch.testing.assert_close(_causal_depthwise(x.transpose(1, 2), w), want, rtol=1e-12, atol=1e-12)


def test_qk_conv_traces_to_elementwise_ops_not_a_convolution():
    """With dynamic shapes the projection's graph has no convolution (inductor's convolution backward
    guards the input gradient's strides to ints, one graph per length) and its length stays symbolic."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    m = MultiHeadProjection(32, 4, None, "blocked", qk_conv=4)
    torch._dynamo.reset()
    f = torch.compile(lambda x: m.split_heads(x)[1], backend=backend, dynamic=True, fullgraph=True)
    for T in (9, 13):
        x = torch.randn(2, T, 32)
        torch.testing.assert_close(f(x), m.split_heads(x)[1])
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert not any("conv" in t for t in targets), targets


def test_compiled_qk_conv_under_bf16_autocast_has_the_eager_gradients():
    """The projection with ``qk_conv`` compiled (inductor) under bf16 autocast: the taps' and the input's
    gradients are the eager ones. 256 q/k channels and 64 tokens make inductor's CPU code tile the
    fused backward in 32 x 32 blocks; when the convolution read its input channels-first, that backward
    transposed bf16 tiles and on AVX-512 gave garbage taps' gradients (NaN in most channels)."""
    torch.manual_seed(0)
    m = MultiHeadProjection(128, 2, None, "blocked", qk_conv=4)
    with torch.no_grad():
        m.qk_conv_weight.normal_()
    x = torch.randn(8, 64, 128)

    def loss(f):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = f(x)
            return (q.float() ** 2).sum() + (k.float() ** 2).sum() + v.float().sum()

    params = (m.qk_conv_weight, m.qkv_proj.weight)
    got = torch.autograd.grad(loss(torch.compile(m.split_heads, fullgraph=True)), params)
    want = torch.autograd.grad(loss(m.split_heads), params)
    assert_finite_grads_close(got, want, ("qk_conv_weight", "qkv_proj.weight"), torch.bfloat16)


def test_qk_conv_mixes_earlier_tokens_only():
    """With taps w (oldest first), k_t = sum_j w_j * proj(x)_{t-K+1+j}, zero before the start."""
    torch.manual_seed(0)
    m = MultiHeadProjection(16, 2, None, "blocked", qk_conv=3)
    with torch.no_grad():
        m.qk_conv_weight.copy_(torch.randn_like(m.qk_conv_weight))
    x = torch.randn(1, 6, 16)
    q, k, v = m.split_heads(x)
    raw = m.qkv_proj(x)[0]  # [T, 3*H*D]
    w = m.qk_conv_weight[:, 0, :]  # [2*H*D, K]
    expected = torch.zeros(6, 32)
    for t in range(6):
        for j in range(3):
            s = t - 2 + j
            if s >= 0:
                expected[t] += w[:, j] * raw[s, :32]
    got = torch.cat([q[0].transpose(0, 1).reshape(6, 16), k[0].transpose(0, 1).reshape(6, 16)], dim=-1)
    assert torch.allclose(got, expected, atol=1e-5)
    # v is its own product (docs/design.md §7), not a slice of qkv_proj's: equal to rounding (bit for bit on one
    # thread; a product of other shapes may sum in another order on several)
    assert_close(v[0].transpose(0, 1).reshape(6, 16), raw[:, 32:], FWD_TOL[torch.float32], "v")


@pytest.mark.parametrize("make", [lambda: SlidingWindowAttention(32, 2, window=8, qk_conv=4, backend="blocked"),
                                  lambda: OVQAttention(32, 2, chunk_size=16, max_centroids=8, qk_conv=4,
                                                       backend="blocked")], ids=["swa", "ovq"])
def test_layers_with_qk_conv_stay_causal(make):
    torch.manual_seed(0)
    layer = make()
    with torch.no_grad():
        layer.qk_conv_weight.normal_()
    x = torch.randn(1, 40, 32, requires_grad=True)
    layer(x)[0, 20].sum().backward()
    assert x.grad[0, 21:].abs().max() == 0 and x.grad[0, :21].abs().max() > 0
    assert layer.qk_conv_weight.grad.abs().max() > 0


DTYPE_LAYERS = {
    "ovq": lambda: ovqflex.OVQAttention(32, 2, chunk_size=16, max_centroids=8, backend="dense"),
    "kvm": lambda: ovqflex.KVMAttention(32, 2, chunk_size=16, backend="dense"),
    "causal": lambda: ovqflex.CausalAttention(32, 2, backend="dense"),
    "linear": lambda: ovqflex.LinearAttention(32, 2),
    "longvq": lambda: ovqflex.LongVQBlock(32, 2, chunk_size=16, codebook_size=4, backend="dense"),
}


@pytest.mark.parametrize("dtype, match", [
    (torch.float16, "x must have dtype torch.float32 \\(the layer's parameters\\), got torch.float16"),
    (torch.int64, "x must be a floating tensor of dtype torch.float32 \\(the layer's parameters\\), got torch.int64"),
], ids=["fp16", "int64"])
@pytest.mark.parametrize("name", list(DTYPE_LAYERS))
def test_input_dtype_must_match_the_parameters(name, dtype, match):
    """A layer names the dtype it expects (not torch's 'expected m1 and m2 to have the same dtype')."""
    layer = DTYPE_LAYERS[name]()
    with pytest.raises(TypeError, match=match):
        layer(torch.zeros(1, 16, 32).to(dtype))


@pytest.mark.parametrize("name", list(DTYPE_LAYERS))
def test_autocast_takes_any_floating_input_but_not_ints(name):
    layer = DTYPE_LAYERS[name]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(1, 16, 32).to(torch.bfloat16))
        with pytest.raises(TypeError, match="x must be a floating tensor of dtype torch.float32"):
            layer(torch.zeros(1, 16, 32, dtype=torch.int64))
    assert y.shape == (1, 16, 32) and torch.isfinite(y.float()).all()
