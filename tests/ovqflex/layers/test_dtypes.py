"""bf16 layers under CPU autocast: the OVQ and KVM layers route like their sequential references on
the same (bf16) inputs (identical routes, up to near-ties: docs/design.md §9), and OVQ's prefill +
decode equals its full forward, as VQ's and LongVQ's do (their window keys in the values' dtype); compiled, a
layer hands its op the inputs the eager layer does (recurrences/precision.py, rule 4)."""
import pytest
import torch

import ovqflex
from recurrences.reference import kvm_attention_reference, ovq_attention_reference
from tests.helpers import FWD_TOL, assert_close, perturbed, prefill_then_decode, reference_on_routes

bf16 = torch.bfloat16


def test_ovq_layer_under_cpu_autocast_routes_like_the_reference_and_decodes():
    torch.manual_seed(0)
    layer = ovqflex.OVQAttention(32, 2, chunk_size=16, max_centroids=24, backend="blocked", block_size=16)
    x = torch.randn(2, 100, 32)
    with torch.autocast("cpu", dtype=bf16):
        y = layer(x)
        q, k, v = layer.split_heads(x)
        _, state = ovqflex.ovq_attention(q, k, v, layer.beta, chunk_size=16, max_centroids=24, backend="blocked",
                                         return_state=True, block_size=16)
    ref = reference_on_routes(
        lambda **forced: ovq_attention_reference(q, k, v, layer.beta, chunk_size=16, max_centroids=24, **forced),
        routes=state.routes)
    assert y.dtype == bf16 and q.dtype == bf16
    with torch.autocast("cpu", dtype=bf16):
        y_ref = layer.merge(ref.out)
    assert_close(y.float(), y_ref.float(), FWD_TOL[bf16], "layer vs reference")
    with torch.no_grad(), torch.autocast("cpu", dtype=bf16):  # the decode cache routes on the same fp32 keys
        full, decoded = layer(x), prefill_then_decode(layer, x, 37)
    assert_close(decoded.float(), full.float(), FWD_TOL[bf16], "prefill + decode in bf16")


KVM_OPTIONS = ("chunk_size", "n_bswa_chunks", "sink_len", "rope_dims", "budget", "growth_factor", "max_state_chunks")


def test_kvm_layer_under_cpu_autocast_routes_like_the_reference():
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(32, 2, chunk_size=16, budget="power_law", growth_factor=4.0, max_state_chunks=None,
                                 backend="blocked", block_size=16)
    x = torch.randn(2, 100, 32)
    with torch.autocast("cpu", dtype=bf16):
        y = layer(x)
        q, k, v, gate, _ = layer._project(x, None)
        readout = layer._readout()._asdict()
        _, state = ovqflex.kvm_attention(q, k, v, gate, backend="blocked", return_state=True, options=layer.options,
                                         **readout)
    assert y.dtype == bf16 and q.dtype == k.dtype == v.dtype == gate.dtype == bf16
    options = {n: getattr(layer.options, n) for n in KVM_OPTIONS}
    ref = reference_on_routes(lambda **forced: kvm_attention_reference(q, k, v, gate, **readout, **options, **forced),
                              routes=state.routes, founder=state.founder)
    with torch.autocast("cpu", dtype=bf16):
        y_ref = layer.merge(ref.out)
    assert_close(y.float(), y_ref.float(), FWD_TOL[bf16], "layer vs reference")


def _eager_and_compiled(op_inputs, x, names):
    """``op_inputs(x)`` (a layer's bf16 op inputs under autocast) eager and compiled, no grad, after checking
    that each named tensor of the two differs in at most 0.1% of its elements (fp32 reduction order or
    another libm may move a rare rounding; a dropped or doubled one moves a tenth to a half)."""
    torch._dynamo.reset()
    with torch.no_grad():
        eager, compiled = op_inputs(x), torch.compile(op_inputs, fullgraph=True)(x)
    for name, e, c in zip(names, eager, compiled, strict=True):
        assert e.dtype == c.dtype == bf16 and (e != c).float().mean() <= 1e-3, name
    return eager, compiled


def test_compiled_kvm_layer_hands_its_op_the_eager_layers_inputs_under_autocast():
    """Under bf16 autocast the compiled KVM layer's q, k (after a trained q/k convolution) and gates equal
    the eager layer's, so both route alike: each chain is computed in fp32 and rounded once. Rounded
    after every op, eagerly, about half of q and k and 12% of the gates differed from the compiled
    layer's (which fuses each chain and rounds once) and, at 1,000 tokens, up to 2% of the routes."""
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(32, 2, chunk_size=16, budget="power_law", growth_factor=4.0, max_state_chunks=None,
                                 qk_conv=4, backend="blocked", block_size=16)
    with torch.no_grad():
        layer.qk_conv_weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))  # as after training
    x = torch.randn(2, 300, 32, generator=torch.Generator().manual_seed(2))

    def op_inputs(x):
        with torch.autocast("cpu", dtype=bf16):
            return layer._project(x, None)[:4]

    eager, compiled = _eager_and_compiled(op_inputs, x, ["q", "k", "v", "gate"])
    with torch.no_grad():
        routes = [ovqflex.kvm_attention(*inputs, backend="blocked", return_state=True, options=layer.options,
                                        **layer._readout()._asdict())[1].routes for inputs in (eager, compiled)]
    assert (routes[0] != routes[1]).float().mean() <= 1e-3


def test_compiled_longvq_layer_hands_its_op_the_eager_layers_inputs_under_autocast():
    """Under bf16 autocast the compiled LongVQ layer's q, k and attention gate equal the eager layer's but
    for a rare rounding: the damped EMA runs in fp32 (autocast ran its einsums in bf16) and returns a
    contiguous tensor (its channel-major result made the eager ``z_proj`` round 15% of q and k otherwise
    than the compiled layer)."""
    torch.manual_seed(0)
    layer = ovqflex.LongVQBlock(32, 2, chunk_size=16, codebook_size=16, backend="blocked", block_size=16)
    x = torch.randn(2, 300, 32, generator=torch.Generator().manual_seed(2))

    def op_inputs(x):
        with torch.autocast("cpu", dtype=bf16):
            inputs = layer._project(x, None, False)
        return inputs.q, inputs.k, inputs.v, inputs.g_a

    _eager_and_compiled(op_inputs, x, ["q", "k", "v", "g_a"])


@pytest.mark.parametrize("name", ["vq", "longvq"])
def test_vq_layers_under_cpu_autocast_keep_one_dtype_in_their_window_and_decode_like_the_forward(name):
    """Under bf16 autocast the VQ layers' window holds its quantized keys in the values' dtype (bf16, as the
    decode steps append them), and prefill + decode equals the full forward."""
    torch.manual_seed(0)
    options = dict(chunk_size=16, codebook_size=8, backend="blocked")
    layer = perturbed({"vq": lambda: ovqflex.VQAttention(32, 2, local_bias=True, **options),
                       "longvq": lambda: ovqflex.LongVQBlock(32, 2, **options)}[name]()).eval()
    x = torch.randn(2, 70, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=bf16):
        _, cache = layer(x[:, :37], use_cache=True)
        assert cache.win_k.dtype == cache.win_v.dtype == bf16
        _, cache = layer(x[:, 37:50], cache=cache)
        assert cache.win_k.dtype == cache.win_v.dtype == bf16
        full, decoded = layer(x), prefill_then_decode(layer, x, 37)
    assert_close(decoded.float(), full.float(), FWD_TOL[bf16], "prefill + decode in bf16")
