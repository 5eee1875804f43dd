"""Op scenarios: a method's fused op vs its reference loop vs causal SDPA, with FLOP efficiency."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...methods import Method, get_method
from ..measure import compare_cases
from .base import Scenario, register


@dataclass(kw_only=True)
class OpScenario(Scenario):
    """Keys of every per-method op scenario (:func:`_op_scenario`)."""

    seq_lens: list[int]
    heads: int = 4
    head_dim: int = 64
    chunk_size: int = 128
    max_backward_len: int = 1 << 30  # the blocked fwd+bwd case runs up to this length
    repeats: int = 3


def _op_scenario(sc: OpScenario, device: str, method: Method, *, op, extra, options: dict, flops) -> list[dict]:
    """Shared driver of the per-method op scenarios, at each ``seq_len`` of ``seq_lens``:
    the fused op (flex forward, compiled and eager; blocked forward+backward up to
    ``max_backward_len``) vs the method's sequential ``reference`` loop vs causal SDPA.

    ``op(q=, k=, v=, **extra, backend=, **options)`` and ``method.reference(...)`` take the same
    keyword tensors; ``extra(T, H, D, generator, device)`` makes the method's extra inputs;
    ``flops(T, H, D)`` its model FLOPs.
    """
    import torch.nn.functional as F

    from ..measure import matmul_gflops

    dev = torch.device(device)
    H, D = sc.heads, sc.head_dim
    repeats, peak = sc.repeats, matmul_gflops(dev)
    rows = []
    for T in sc.seq_lens:
        g = torch.Generator().manual_seed(0)
        t = dict(zip("qkv", (torch.randn(1, H, T, D, generator=g).to(dev) for _ in range(3))))
        t.update(extra(T, H, D, g, dev))
        grad_t = {n: x.clone().requires_grad_() for n, x in t.items()}
        # dynamic=False: a second length would otherwise trace dynamic shapes, which CPU flex
        # codegen rejects (docs/design.md §11)
        compiled = torch.compile(lambda inputs: op(**inputs, backend="flex", **options), fullgraph=True,
                                 dynamic=False)

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    return fn()
            return run

        fl = flops(T, H, D)
        cases = [("fused flex fwd, compiled op", no_grad(lambda: compiled(t)), fl),
                 ("fused flex fwd, eager op", no_grad(lambda: op(**t, backend="flex", **options)), fl),
                 ("reference loop fwd", no_grad(lambda: method.reference(**t, **options).out), fl),
                 ("sdpa causal fwd", no_grad(lambda: F.scaled_dot_product_attention(t["q"], t["k"], t["v"],
                                                                                    is_causal=True)),
                  4.0 * H * D * T * (T + 1) / 2)]
        if T <= sc.max_backward_len:
            cases.append(("fused blocked fwd+bwd",
                          lambda: op(**grad_t, backend="blocked", **options).sum().backward(), 3 * fl))
        rows += compare_cases(T, cases, dev, repeats, peak_gflops=peak)
    return rows


@dataclass(kw_only=True)
class OVQScenario(OpScenario):
    max_centroids: int


@register("ovq", OVQScenario)
def ovq(sc: OVQScenario, device: str) -> list[dict]:
    """OVQ op (docs/design.md §4.2) through :func:`_op_scenario`."""
    from ...ops.ovq import OVQOptions, ovq_attention

    options = dict(chunk_size=sc.chunk_size, max_centroids=sc.max_centroids)
    method = get_method("ovq")
    return _op_scenario(
        sc, device, method, op=ovq_attention,
        extra=lambda T, H, D, g, dev: {"beta": torch.full((H,), D**0.5, device=dev)}, options=options,
        flops=lambda T, H, D: method.flops(T, H, D, OVQOptions(**options)))


@dataclass(kw_only=True)
class KVMStateKeys:
    """The KVM keys of a scenario: :func:`ovqflex.kvm_attention`'s window, sink and budget options,
    with its defaults (TOML has no null: ``state_min_len = 0`` is the default one chunk,
    ``max_state_chunks = 0`` uncapped)."""

    n_bswa_chunks: int = 2
    sink_len: int = 1
    budget: str = "fixed"
    state_min_len: int = 0
    growth_factor: float = 16.0
    growth_exponent: float = 0.5
    round_down: int = 1
    saturation_n: int = 1024
    max_state_chunks: int = 1

    def kvm_options(self, chunk_size: int) -> dict:
        """The :class:`~ovqflex.ops.kvm.KVMOptions` keywords of these keys and ``chunk_size``."""
        return dict(chunk_size=chunk_size, n_bswa_chunks=self.n_bswa_chunks, sink_len=self.sink_len,
                    budget=self.budget, state_min_len=self.state_min_len or None, growth_factor=self.growth_factor,
                    growth_exponent=self.growth_exponent, round_down=self.round_down,
                    saturation_n=self.saturation_n, max_state_chunks=self.max_state_chunks or None)


@dataclass(kw_only=True)
class KVMScenario(OpScenario, KVMStateKeys):
    """An op scenario with the KVM keys (:class:`KVMStateKeys`)."""


@register("kvm", KVMScenario)
def kvm(sc: KVMScenario, device: str) -> list[dict]:
    """KVM op (docs/design.md §4.3) through :func:`_op_scenario`."""
    import functools

    import torch.nn.functional as F

    from ...ops.kvm import KVMOptions, kvm_attention

    options = sc.kvm_options(sc.chunk_size)
    opts, method = KVMOptions(**options), get_method("kvm")
    sizes = functools.cache(opts.state_sizes)  # state rows of each chunk at length T

    def extra(T, H, D, g, dev):
        return dict(gate=(1 + F.elu(torch.randn(1, H, T, generator=g))).to(dev),
                    ln_s_weight=torch.ones(D, device=dev), ln_s_bias=torch.zeros(D, device=dev),
                    tau_state=torch.ones(H, device=dev), tau_bswa=torch.ones(H, device=dev))

    rows = _op_scenario(sc, device, method, op=kvm_attention, extra=extra, options=options,
                        flops=lambda T, H, D: method.flops(T, H, D, opts))
    for row in rows:
        row["state_rows_last_chunk"] = (sizes(row["T"]) or [0])[-1]
    return rows


@dataclass(kw_only=True)
class VQScenario(OpScenario):
    codebook_size: int = 512


@register("vq", VQScenario)
def vq(sc: VQScenario, device: str) -> list[dict]:
    """VQ-attention op (docs/design.md §4.4) through :func:`_op_scenario`; its "reference loop" is the
    quadratic form ``softmax(q K̂ᵀ + causal) V`` (dense, O(T²) memory: keep T moderate)."""
    from ...ops.vq import VQOptions, vq_attention

    N, method = sc.codebook_size, get_method("vq")
    options = dict(chunk_size=sc.chunk_size)

    def extra(T, H, D, g, dev):
        return {"codebook": torch.randn(H, N, D, generator=g).to(dev), "beta": torch.full((H,), D**0.5, device=dev)}

    return _op_scenario(sc, device, method, op=lambda **a: vq_attention(**a)[0], extra=extra, options=options,
                        flops=lambda T, H, D: method.flops(T, H, D, VQOptions(**options), codebook_size=N))
