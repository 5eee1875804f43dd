"""bf16 layers under CPU autocast: the OVQ and KVM layers route exactly like their sequential
references on the same (bf16) inputs, and OVQ's prefill + decode equals its full forward."""
import torch

import ovqflex
from recurrences.reference import kvm_attention_reference, ovq_attention_reference
from tests.helpers import FWD_TOL, assert_close

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
    ref = ovq_attention_reference(q, k, v, layer.beta, chunk_size=16, max_centroids=24)
    assert y.dtype == bf16 and q.dtype == bf16
    assert torch.equal(state.routes, ref.routes)
    with torch.autocast("cpu", dtype=bf16):
        y_ref = layer.merge(ref.out)
    assert_close(y.float(), y_ref.float(), FWD_TOL[bf16], "layer vs reference")
    with torch.no_grad(), torch.autocast("cpu", dtype=bf16):  # the decode cache routes on the same fp32 keys
        full = layer(x)
        y1, cache = layer(x[:, :37], use_cache=True)
        outs = [y1]
        for i in range(37, 100):
            y1, cache = layer(x[:, i:i + 1], cache=cache)
            outs.append(y1)
    assert_close(torch.cat(outs, 1).float(), full.float(), FWD_TOL[bf16], "prefill + decode in bf16")


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
    ref = kvm_attention_reference(q, k, v, gate, **readout, **{n: getattr(layer.options, n) for n in KVM_OPTIONS})
    assert torch.equal(state.routes, ref.routes)
    with torch.autocast("cpu", dtype=bf16):
        y_ref = layer.merge(ref.out)
    assert_close(y.float(), y_ref.float(), FWD_TOL[bf16], "layer vs reference")
