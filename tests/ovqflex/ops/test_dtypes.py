"""The dtype rule at the op boundary (``recurrences.precision``) on every op: mixed input dtypes are
cast to one compute dtype (== the explicitly cast call), and in bf16 the fused ops route like their
sequential references on the same inputs (identical routes, up to near-ties: docs/design.md §9). The
layers under CPU autocast: ``tests/ovqflex/layers/test_dtypes.py``."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ovqflex
from recurrences.reference import (delta_rule_reference, kvm_attention_reference, linear_attention_reference,
                                   ovq_attention_reference, vla_reference, vq_attention_reference)
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close, reference_on_routes

f32, bf16 = torch.float32, torch.bfloat16
ROOT = Path(__file__).resolve().parents[3]
B, H, T, D = 2, 2, 150, 16


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, u = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    return dict(q=q, k=k, v=v, u=u, k_unit=F.normalize(k, dim=-1), gate=1 + F.elu(torch.randn(B, H, T, generator=g)),
                beta_t=torch.rand(B, H, T, generator=g), beta=D**0.5 * (0.5 + torch.rand(H, generator=g)),
                codebook=torch.randn(H, 12, D, generator=g), ln_w=1 + 0.2 * torch.randn(D, generator=g),
                ln_b=0.2 * torch.randn(D, generator=g), tau=0.5 + torch.rand(H, generator=g))


# name -> (op on a dict of inputs, the per-token inputs it casts with q, k, v)
OPS = {
    "swa-sinks": (lambda t: ovqflex.sliding_window_attention(t["q"], t["k"], t["v"], window=24, n_sinks=2,
                                                             backend="blocked", block_size=16), ()),
    "ovq": (lambda t: ovqflex.ovq_attention(t["q"], t["k"], t["v"], t["beta"], chunk_size=16, max_centroids=12,
                                            backend="blocked", block_size=16), ()),
    "kvm": (lambda t: ovqflex.kvm_attention(t["q"], t["k"], t["v"], t["gate"], ln_s_weight=t["ln_w"],
                                            ln_s_bias=t["ln_b"], tau_state=t["tau"], tau_bswa=t["tau"],
                                            chunk_size=16, budget="power_law", growth_factor=4.0,
                                            max_state_chunks=None, backend="blocked", block_size=16), ("gate",)),
    "vq": (lambda t: ovqflex.vq_attention(t["q"], t["k"], t["v"], t["codebook"], t["beta"], chunk_size=16,
                                          backend="blocked", block_size=16)[0], ()),
    "linear": (lambda t: ovqflex.linear_attention(t["q"], t["k"], t["v"], chunk_size=16), ()),
    "delta": (lambda t: ovqflex.delta_rule(t["q"], t["k_unit"], t["v"], t["beta_t"], chunk_size=16), ("beta_t",)),
    "vla": (lambda t: ovqflex.vla_attention(t["q"], t["k"], t["v"], t["u"], chunk_size=10), ("u",)),
}


def _cast(t: dict, dtypes: dict) -> dict:
    return {n: x.to(dtypes[n]) if n in dtypes else x for n, x in t.items()}


@pytest.mark.parametrize("name", list(OPS))
def test_mixed_dtypes_equal_the_explicitly_cast_call(name):
    """q, k fp32 and v bf16 (what CUDA autocast hands the ops) run as the fp32 call; a bf16
    companion (gate, beta, u) too."""
    op, companions = OPS[name]
    t = _cast(_inputs(), {"v": bf16} | {c: bf16 for c in companions})
    mixed = op(t)
    cast = op(_cast(t, {n: f32 for n in ("q", "k", "k_unit", "v", *companions)}))
    assert mixed.dtype == f32
    assert torch.equal(mixed, cast)


@pytest.mark.parametrize("name", list(OPS))
def test_under_autocast_the_op_runs_in_the_autocast_dtype(name):
    """Under autocast q, k, v (and companions) go to the autocast dtype, whatever they came in."""
    op, companions = OPS[name]
    t = _cast(_inputs(), {"v": bf16})
    with torch.autocast("cpu", dtype=bf16):
        mixed = op(t)
        cast = op(_cast(t, {n: bf16 for n in ("q", "k", "k_unit", "v", *companions)}))
    assert mixed.dtype == bf16
    assert torch.equal(mixed, cast)


def _bits_with_and_without_autocast(name: str) -> dict:
    """Whether ``OPS[name]`` on bf16 inputs (VQ's codebook too) gives the same output and q, k, v gradients under
    bf16 autocast as without it: ``{"out": bool, "grads": [bool, bool, bool]}``."""
    op, companions = OPS[name]
    runs = []
    for autocast in (False, True):
        t = _cast(_inputs(), {n: bf16 for n in ("q", "k", "k_unit", "v", "codebook", *companions)})
        leaves = _leaves(t, ("q", "k_unit" if name == "delta" else "k", "v"))
        with torch.autocast("cpu", dtype=bf16, enabled=autocast):
            out = op(t)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        runs.append((out, torch.autograd.grad((out.float() * w).sum(), leaves)))
    (out, grads), (out_ac, grads_ac) = runs
    return {"out": torch.equal(out, out_ac), "grads": [torch.equal(a, b) for a, b in zip(grads, grads_ac)]}


def test_under_cudas_autocast_rule_every_op_computes_as_without_autocast():
    """On bf16 inputs each op gives the same bits, output and gradients, under bf16 autocast as without it, with
    CUDA's autocast rule followed on the CPU (``tools/cuda_rules.py``, in a process of its own): CUDA's autocast
    runs ``layer_norm``, the norms, ``exp``, ``sum`` and more in fp32, so an op that leaves one to autocast
    computes otherwise under it there (KVM's ``LN_s`` made a bf16 layer's key sums fp32; OVQ's and VQ's unit
    queries and keys were fp32 before their rounding). The ops run with autocast off inside where it matters
    (docs/precision.md); the CPU's own autocast is checked in-process above."""
    code = """
import json, torch
from tools.cuda_rules import follow_cuda_rules
follow_cuda_rules()
from tests.ovqflex.ops.test_dtypes import OPS, _bits_with_and_without_autocast
print(json.dumps({name: _bits_with_and_without_autocast(name) for name in OPS}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    same = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(same) == set(OPS)
    differ = {name: r for name, r in same.items() if not (r["out"] and all(r["grads"]))}
    assert not differ, f"ops whose bits change under CUDA's autocast rule: {differ}"


def _leaves(t: dict, names) -> list:
    return [t[n].requires_grad_() for n in names]


def _grads_close(out, ref, leaves, seed):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad((out * w).float().sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).float().sum(), leaves)
    assert_close(out.float(), ref.float(), FWD_TOL[bf16], "forward")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert_close(a, b, GRAD_TOL[bf16], f"grad of leaf {i}", floor=0.1)


@pytest.mark.parametrize("layout, seed", [("snapshot", 0), ("versioned", 1)])
def test_ovq_bf16_routes_like_its_reference(layout, seed):
    t = _inputs(seed)
    leaves = _leaves(t, ("q", "k", "v", "beta"))
    q, k, v = (t[n].bfloat16() for n in "qkv")
    kw = dict(chunk_size=16, max_centroids=24)
    out, state = ovqflex.ovq_attention(q, k, v, t["beta"], backend="blocked", state_layout=layout,
                                       return_state=True, block_size=16, **kw)
    ref = reference_on_routes(lambda **forced: ovq_attention_reference(q, k, v, t["beta"], **kw, **forced),
                              routes=state.routes)
    assert out.dtype == bf16
    _grads_close(out, ref.out, leaves, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_kvm_bf16_routes_like_its_reference(seed):
    t = _inputs(seed)
    leaves = _leaves(t, ("q", "k", "v", "gate"))
    q, k, v, gate = (t[n].bfloat16() for n in ("q", "k", "v", "gate"))
    kw = dict(ln_s_weight=t["ln_w"], ln_s_bias=t["ln_b"], tau_state=t["tau"], tau_bswa=t["tau"], chunk_size=16,
              budget="power_law", growth_factor=4.0, max_state_chunks=None)
    out, state = ovqflex.kvm_attention(q, k, v, gate, backend="blocked", return_state=True, block_size=16, **kw)
    ref = reference_on_routes(lambda **forced: kvm_attention_reference(q, k, v, gate, **kw, **forced),
                              routes=state.routes, founder=state.founder)
    assert out.dtype == bf16
    _grads_close(out, ref.out, leaves, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_vq_bf16_codes_like_its_reference(seed):
    t = _inputs(seed)
    leaves = _leaves(t, ("q", "v", "beta"))
    q, k, v = (t[n].bfloat16() for n in "qkv")
    out, aux = ovqflex.vq_attention(q, k, v, t["codebook"], t["beta"], chunk_size=16, backend="blocked",
                                    block_size=16)
    ref = reference_on_routes(
        lambda **forced: vq_attention_reference(q, k, v, t["codebook"], t["beta"], chunk_size=16, **forced),
        codes=aux["codes"])
    assert out.dtype == bf16
    _grads_close(out, ref.out, leaves, seed)


f64 = torch.float64
_KVM_F64 = dict(chunk_size=16, budget="power_law", growth_factor=4.0, max_state_chunks=None)


def _kvm_params(t: dict) -> dict:
    return dict(ln_s_weight=t["ln_w"], ln_s_bias=t["ln_b"], tau_state=t["tau"], tau_bswa=t["tau"])


def _ovq_f64(layout: str):
    return (lambda t: ovqflex.ovq_attention(t["q"], t["k"], t["v"], t["beta"], chunk_size=16, max_centroids=12,
                                            state_layout=layout, block_size=16),
            lambda t: ovq_attention_reference(t["q"], t["k"], t["v"], t["beta"], chunk_size=16,
                                              max_centroids=12).out)


def _kvm_f64(layout: str):
    return (lambda t: ovqflex.kvm_attention(t["q"], t["k"], t["v"], t["gate"], state_layout=layout, block_size=16,
                                            **_kvm_params(t), **_KVM_F64),
            lambda t: kvm_attention_reference(t["q"], t["k"], t["v"], t["gate"], **_kvm_params(t), **_KVM_F64).out)


# name -> (fused op on float64 inputs with backend "auto", its sequential reference): outputs [B, H, T, Dv]
F64_OPS = {
    "ovq-snapshot": _ovq_f64("snapshot"),
    "ovq-versioned": _ovq_f64("versioned"),
    "kvm-snapshot": _kvm_f64("snapshot"),
    "kvm-versioned": _kvm_f64("versioned"),
    "vq": (lambda t: ovqflex.vq_attention(t["q"], t["k"], t["v"], t["codebook"], t["beta"], chunk_size=16,
                                          block_size=16)[0],
           lambda t: vq_attention_reference(t["q"], t["k"], t["v"], t["codebook"], t["beta"], chunk_size=16).out),
    "linear": (lambda t: ovqflex.linear_attention(t["q"], t["k"], t["v"], chunk_size=16),
               lambda t: linear_attention_reference(t["q"], t["k"], t["v"]).out),
    "delta": (lambda t: ovqflex.delta_rule(t["q"], t["k_unit"], t["v"], t["beta_t"], chunk_size=16),
              lambda t: delta_rule_reference(t["q"], t["k_unit"], t["v"], t["beta_t"]).out),
    "vla": (lambda t: ovqflex.vla_attention(t["q"], t["k"], t["v"], t["u"], chunk_size=10),
            lambda t: vla_reference(t["q"], t["k"], t["v"], t["u"]).out),
}


@pytest.mark.parametrize("name", list(F64_OPS))
def test_float64_ops_equal_their_references_in_float64(name):
    """In float64 every op, with ``backend="auto"`` (no grad: inference; grad: training), is its
    reference to float64 precision, gradients too: nothing on the way computes in fp32 but the
    routing copies (whose decisions are the references' too). Before, the attention ops failed in
    inductor's CPU flex lowering without a grad, KVM's founder radius failed, and scores, log counts
    (and the OVQ and VQ references' running-mean rates and softmax) were fp32, ~1e-8."""
    op, ref_op = F64_OPS[name]
    t = {n: x.double() for n, x in _inputs(2).items()}
    with torch.no_grad():
        out = op(t)
    ref = ref_op(t)
    assert out.dtype == f64
    assert_close(out, ref, FWD_TOL[f64], "forward, no grad")
    names = {"vq": ("q", "v", "beta"), "delta": ("q", "k_unit", "v", "beta_t")}.get(name, ("q", "k", "v"))
    leaves = [t[n].requires_grad_() for n in names]  # (VQ's key gradient is its estimator's, not the reference's)
    out, ref = op(t), ref_op(t)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=f64)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    assert_close(out, ref, FWD_TOL[f64], "forward")
    for n, a, b in zip(names, grads, ref_grads):
        assert_close(a, b, GRAD_TOL[f64], f"d{n}")


def busy_rows(name: str, layout: str, dtype: torch.dtype, device: torch.device | str = "cpu",
              backend: str = "blocked") -> torch.Tensor:
    """The op on 2,048 tokens whose keys nearly share one direction: OVQ's 2 slots and VQ's 2 codes each sum a
    thousand values near 100, KVM's busiest rows (its LN_s spreads such keys: 66 tokens at most) values near
    2,000; past fp16's largest value (65,504) either way. Inputs rounded to fp16, then run in ``dtype`` on
    ``device``."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2048, 8, generator=g)
    k = 1.0 + 0.01 * torch.randn(1, 2, 2048, 8, generator=g)
    v = (2000.0 if name == "kvm" else 100.0) + torch.randn(1, 2, 2048, 8, generator=g)
    codebook = torch.randn(2, 2, 8, generator=g).to(device)
    q, k, v = (x.half().to(device=device, dtype=dtype) for x in (q, k, v))
    ones, zeros = torch.ones(8, device=device), torch.zeros(8, device=device)
    kw = dict(chunk_size=64, backend=backend, state_layout=layout)
    if name == "ovq":
        return ovqflex.ovq_attention(q, k, v, ones[:2], max_centroids=2, **kw)
    if name == "kvm":
        return ovqflex.kvm_attention(q, k, v, ln_s_weight=ones, ln_s_bias=zeros, **kw)
    return ovqflex.vq_attention(q, k, v, codebook, ones[:2], **kw)[0]


@pytest.mark.parametrize("layout", ["snapshot", "versioned"])
@pytest.mark.parametrize("name", ["ovq", "kvm", "vq"])
def test_fp16_state_sums_past_fp16s_range_stay_finite(name, layout):
    """An fp16 op keeps its state sums in fp32 (``recurrences.segments.sum_dtype``) and rounds the rows it reads
    once: on rows whose sums pass 65,504 it equals the fp32 op on the same fp16 values to fp16's tolerance (in
    fp16 those sums had been inf, and the outputs NaN)."""
    got, want = busy_rows(name, layout, torch.float16), busy_rows(name, layout, f32)
    assert got.dtype == torch.float16 and got.isfinite().all()
    assert_close(got.float(), want, FWD_TOL[torch.float16], f"{name} {layout} fp16")
