"""Which layers ``ovqflex viz`` can draw: a small registry of methods.

A method is a layer factory ``(hidden, heads, head_dim, **options) -> layer`` whose layer
has ``program(x [B, T, hidden]) -> AttentionProgram`` (the attention program of that
input, built without running attention), plus the per-region temperatures folded into
its logits for the inspector. Adding a method is one line, e.g.::

    register_viz_method("kvm", VizMethod(lambda hidden, heads, head_dim, **o:
                        KVMAttention(hidden, heads, head_dim=head_dim, **o),
                        temperatures=lambda m: {"state": m.tau_state, "window": m.tau_bswa}))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from masks.program import AttentionProgram
from recurrences.checks import check_int

from .layers import CausalAttention, KVMAttention, LongVQBlock, OVQAttention, SlidingWindowAttention, VQAttention


@dataclass
class VizMethod:
    """``factory(hidden, heads, head_dim, **options)`` builds the layer; ``defaults`` are
    options used unless overridden; ``temperatures(layer)`` maps region names to ``[H]``
    logit multipliers folded into q or k rows (inspector column)."""

    factory: Callable[..., nn.Module]
    defaults: dict = field(default_factory=dict)
    temperatures: Callable[[nn.Module], dict[str, Tensor | float]] | None = None
    description: str = ""


VIZ_METHODS: dict[str, VizMethod] = {}


def register_viz_method(name: str, method: VizMethod) -> None:
    VIZ_METHODS[name] = method


def _beta_everywhere(layer) -> dict[str, Tensor]:
    return {name: layer.beta.detach() for name in ("sink", "state", "window", "causal")}


def _plain(**fixed):
    return lambda hidden, heads, head_dim, **o: (
        CausalAttention if fixed.get("cls") == "causal" else SlidingWindowAttention)(
        hidden, heads, head_dim=head_dim, **{k: v for k, v in fixed.items() if k != "cls"}, **o)


register_viz_method("ovq", VizMethod(
    lambda hidden, heads, head_dim, **o: OVQAttention(hidden, heads, head_dim=head_dim, **o),
    defaults=dict(chunk_size=128, max_centroids=256), temperatures=_beta_everywhere,
    description="OVQ-attention: per-chunk dictionary snapshot (log-count bias) + own chunk causal"))
register_viz_method("kvm", VizMethod(
    lambda hidden, heads, head_dim, **o: KVMAttention(hidden, heads, head_dim=head_dim, **o),
    defaults=dict(chunk_size=128, n_bswa_chunks=2, sink_len=1, budget="power_law", max_state_chunks=None),
    temperatures=lambda m: {"state": 1.0 if m.tau_state is None else m.tau_state.detach(),
                            "window": 1.0 if m.tau_bswa is None else m.tau_bswa.detach()},
    description="KVM: sinks + growable state (16 sqrt(ctx) rows) + Nb-chunk block window, region temperatures"))
register_viz_method("vq", VizMethod(
    lambda hidden, heads, head_dim, **o: VQAttention(hidden, heads, head_dim=head_dim, **o),
    defaults=dict(chunk_size=128, codebook_size=256), temperatures=_beta_everywhere,
    description="VQ-attention: codebook per chunk (log-count bias, tokens of chunks < c-1) + chunks c-1, c causal"))
register_viz_method("longvq", VizMethod(
    lambda hidden, heads, head_dim, **o: LongVQBlock(hidden, heads, head_dim=head_dim, **o),
    defaults=dict(chunk_size=128, codebook_size=256), temperatures=_beta_everywhere,
    description="LongVQ block's VQ attention (local bias folded into the codebook rows' bias)"))
register_viz_method("full", VizMethod(_plain(cls="causal"), description="full causal attention"))
register_viz_method("swa", VizMethod(_plain(), defaults=dict(window=128), description="token sliding window"))
register_viz_method("bswa", VizMethod(_plain(), defaults=dict(block_window=2, chunk_size=128),
                                      description="block sliding window of Nb chunks"))
register_viz_method("sinks", VizMethod(_plain(), defaults=dict(window=128, n_sinks=4),
                                       description="StreamingLLM: sinks + token window"))


@dataclass
class VizShape:
    """Input of the drawn layer: ``x [batch, seq_len, heads * head_dim]`` ~ N(0, 1) from ``seed``."""

    seq_len: int = 512
    batch: int = 1
    heads: int = 1
    head_dim: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch", "heads", "head_dim"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, minimum=0)


def method_program(method: str, shape: VizShape, options: dict | None = None
                   ) -> tuple[AttentionProgram, nn.Module, dict[str, Tensor | float]]:
    """Build the layer of ``method`` (seeded init) and its program on a random input.

    Returns ``(program, layer, temperatures)``. Unknown methods and options are refused.
    """
    if method not in VIZ_METHODS:
        raise ValueError(f"method must be one of {sorted(VIZ_METHODS)}, got {method!r}")
    m = VIZ_METHODS[method]
    opts = {**m.defaults, **(options or {})}
    torch.manual_seed(shape.seed)
    hidden = shape.heads * shape.head_dim
    try:
        layer = m.factory(hidden, shape.heads, shape.head_dim, **opts)
    except TypeError as e:
        raise ValueError(f"bad option for method {method!r} (options {opts}): {e}") from None
    g = torch.Generator().manual_seed(shape.seed)
    x = torch.randn(shape.batch, shape.seq_len, hidden, generator=g)
    with torch.no_grad():
        program = layer.program(x)
    temps = m.temperatures(layer) if m.temperatures else {}
    return program, layer, temps
