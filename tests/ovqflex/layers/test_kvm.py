"""KVMAttention layer: == the paper's chunk loop behind the same parameters, ablation switches,
compilation (the op: tests/ovqflex/ops/test_kvm.py)."""
import pytest
import torch
import torch.nn.functional as F

import ovqflex
from ovqflex.layers.kvm import _merge_gate
from recurrences.reference import kvm_attention_reference
from tests.helpers import (FWD_TOL, GRAD_TOL, assert_close, assert_parameter_gradients_match,
                           assert_trains_compiled_once, checked_square_loss, prefill_then_decode)


def _layer_reference(layer, x, *, rope_base, rope_dims, ln_eps):
    """The layer's forward with the paper's loop in place of the fused op (same parameters; ``rope_base``,
    ``rope_dims`` and ``ln_eps`` as the test built the layer, not read back from it)."""
    q, k, v = layer.split_heads(x)
    pos = torch.arange(x.shape[1])
    q = ovqflex.layers.rope.apply_rope(layer.q_norm(q), pos, rope_dims, rope_base, interleaved=True)
    k = ovqflex.layers.rope.apply_rope(layer.k_norm(k), pos, rope_dims, rope_base, interleaved=True)
    gate = (1.0 + F.elu(x @ layer.gate_proj.weight.T)).transpose(1, 2)
    ref = kvm_attention_reference(q, k, v, gate, ln_s_weight=layer.ln_s.weight, ln_s_bias=layer.ln_s.bias,
                                  tau_state=layer.tau_state, tau_bswa=layer.tau_bswa, chunk_size=layer.chunk_size,
                                  n_bswa_chunks=layer.n_bswa_chunks, sink_len=layer.sink_len,
                                  rope_dims=rope_dims, budget=layer.budget, growth_factor=layer.growth_factor,
                                  max_state_chunks=layer.max_state_chunks, ln_eps=ln_eps)
    return layer.merge(ref.out)


def test_layer_gradients_reach_every_parameter_like_the_reference():
    """A RoPE base and an ``LN_s`` epsilon away from their defaults; ``rope_dims`` by default half the head
    (32 channels: 16 rotated); the gate a linear map without bias."""
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(64, 2, chunk_size=16, budget="power_law", growth_factor=4.0, rope_base=500.0,
                                 ln_eps=1e-2, max_state_chunks=None, backend="blocked")
    with torch.no_grad():  # leave the neutral init so temperatures and LN_s matter
        for p in (layer.tau_state, layer.tau_bswa, layer.ln_s.weight, layer.ln_s.bias):
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 150, 64)
    out, ref = layer(x), _layer_reference(layer, x, rope_base=500.0, rope_dims=16, ln_eps=1e-2)
    assert_close(out, ref, FWD_TOL[torch.float32], "layer forward")
    assert {n for n, _ in layer.named_parameters()} == {
        "qkv_proj.weight", "o_proj.weight", "q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias",
        "ln_s.weight", "ln_s.bias", "gate_proj.weight", "tau_state", "tau_bswa"}
    assert_parameter_gradients_match(layer, out, ref)


@pytest.mark.parametrize("use_gate", [True, False], ids=["gated", "no-gate"])
def test_prefill_and_decode_equal_the_full_forward_with_and_without_gates(use_gate):
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(32, 2, chunk_size=16, use_gate=use_gate, backend="blocked").eval()
    x = torch.randn(2, 70, 32)
    with torch.no_grad():
        full, decoded = layer(x), prefill_then_decode(layer, x, 37)
    assert_close(decoded, full, FWD_TOL[torch.float32], "prefill + decode")


def test_layer_ablation_switches():
    x = torch.randn(1, 100, 32)
    full = ovqflex.KVMAttention(32, 2, chunk_size=16, backend="blocked")
    assert full.tau_state.shape == (2,) and torch.equal(full.tau_state, torch.ones(2))
    bare = ovqflex.KVMAttention(32, 2, chunk_size=16, sink_len=0, use_gate=False, use_vlens=False,
                                use_temperatures=False, backend="blocked")
    assert bare.gate_proj is None and bare.tau_state is None and bare.tau_bswa is None
    assert {n for n, _ in bare.named_parameters()} == {"qkv_proj.weight", "o_proj.weight", "q_norm.weight",
                                                      "q_norm.bias", "k_norm.weight", "k_norm.bias",
                                                      "ln_s.weight", "ln_s.bias"}
    assert bare(x).shape == x.shape and full(x).shape == x.shape


def test_layer_trains_under_the_aot_eager_debugging_backend():
    """``torch.compile(layer, backend="aot_eager")``, dynamo's debugging backend (the traced graphs run by
    eager kernels), forward and backward: output and gradients equal the eager layer's. Its backward had
    failed on a ``view`` of the gate's ``F.elu`` gradient (torch's eager ``elu_backward`` and its meta
    function laid a transposed gradient out differently) until the gate was laid out ``[B, H, T]`` before
    its elementwise ops (``ovqflex/layers/kvm.py::_merge_gate``)."""
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(64, 2, chunk_size=16, backend="blocked")
    x = torch.randn(2, 100, 64)
    names, params = zip(*layer.named_parameters())
    torch._dynamo.reset()
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    got = torch.autograd.grad(out.square().mean(), params)
    ref = layer(x)
    want = torch.autograd.grad(ref.square().mean(), params)
    assert_close(out, ref, FWD_TOL[torch.float32], "output")
    for g, w, name in zip(got, want, names):
        assert_close(g, w, GRAD_TOL[torch.float32], f"grad {name}")


def test_layer_compiles_without_graph_break_or_recompile():
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(64, 2, chunk_size=32, budget="power_law", growth_factor=8.0, max_state_chunks=None,
                                 backend="blocked")
    assert_trains_compiled_once(layer, checked_square_loss(layer, torch.randn(2, 200, 64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_gates_keep_their_relative_precision(dtype):
    """``g = 1 + elu(x W_g)`` ``[B, T, H] -> [B, H, T]``, computed in fp32 as ``exp`` below 0 and rounded once to
    the dtype: within an ulp of that dtype of the float64 truth everywhere, the smallest gates too (written
    ``elu + 1``, every gate below ``exp(-17)`` was 0 in fp32)."""
    z = torch.linspace(-60, 4, 3 * 2 * 50).view(3, 50, 2).to(dtype)
    gate = _merge_gate(z)
    z64 = z.double().transpose(1, 2)
    exact = torch.where(z64 > 0, 1 + z64, torch.exp(z64))
    ulp = torch.finfo(dtype).eps
    assert gate.shape == (3, 2, 50) and gate.dtype == dtype and gate.is_contiguous()
    assert ((gate.double() - exact) / exact).abs().max() <= ulp
