"""The method registry: one :class:`Method` per attention method, the only place that names methods.

Everything that offers a choice of methods reads :data:`METHODS`: ``HybridLM`` mixer patterns
(``ovqflex/models/mixers.py``), ``ovqflex viz`` (``ovqflex/viz.py``), ``ovqflex profile``
(``ovqflex/bench/profiler.py``), the ``decode``, ``viz`` and op kinds of ``ovqflex bench``
(``ovqflex/bench/scenarios/``) and the conformance tests (``tests/ovqflex/test_conformance.py``).
A new method is its module (op, layer) plus one :func:`register_method` call; ``docs/adding-a-method.md``
walks through it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable

from torch import Tensor, nn

from recurrences.checks import ConfigError, ConfigTypeError, check_keys
from recurrences.reference import kvm_attention_reference, ovq_attention_reference, vq_attention_reference
from recurrences.vla import VLAOptions

from .layers import (AttentionLayer, CausalAttention, DeltaNetAttention, KVMAttention, LinearAttention, LongVQBlock, OVQAttention,
                     SlidingWindowAttention, VLAAttention, VQAttention)
from .layers.plain import DefaultWindow
from .ops.kvm import KVMOptions, kvm_flops
from .ops.ovq import OVQOptions, ovq_flops
from .ops.vq import VQOptions, vq_flops

if TYPE_CHECKING:
    from .models.config import HybridConfig


@dataclass(frozen=True)
class Method:
    """One attention method and what the rest of ovqflex needs of it.

    - ``layer``: the layer class, an :class:`~ovqflex.layers.AttentionLayer`;
      ``layer(hidden_size, num_heads, **fixed, **options)`` maps x ``[B, T, hidden]`` to y
      ``[B, T, hidden]`` (``(y, aux)`` with ``return_aux=True``). Its ``program(x)`` (if any) makes
      the method drawable; its ``cache_type`` (``supports_cache``) makes it decode.
    - ``fixed``: the options that make this method of ``layer`` (``full`` is a ``CausalAttention``
      with ``rope=True``); a user cannot override them.
    - ``options``: the method's frozen options dataclass (its fields are keyword options of the
      layer and the op), or None.
    - ``from_config``: the layer options a ``HybridConfig`` sets (``config.mixer_options[name]``
      adds and overrides); None: not a ``HybridLM`` mixer.
    - ``defaults``: options of the example layer ``ovqflex viz`` draws and ``ovqflex profile``
      runs (a readable program size), unless overridden.
    - ``temperatures(layer)``: region name -> ``[H]`` logit multipliers folded into q or k rows
      (the inspector's column); None: none.
    - ``test_options``: options of a small, fast instance (a few chunks in 100 tokens, a CPU
      backend) for the conformance tests.
    - ``reference``: the sequential loop the op is checked and benchmarked against (``out`` of
      its result is ``[B, H, T, Dv]``); ``flops(T, H, D, options, **sizes)``: model FLOPs of one
      forward of the op at batch 1 (``options``: an instance of the options dataclass; ``sizes``:
      input sizes the options leave open, e.g. VQ's ``codebook_size``).
    """

    name: str
    layer: type[nn.Module]
    description: str
    fixed: dict = field(default_factory=dict)
    options: type | None = None
    from_config: Callable[[HybridConfig], dict] | None = None
    defaults: dict = field(default_factory=dict)
    temperatures: Callable[[nn.Module], dict[str, Tensor | float]] | None = None
    test_options: dict = field(default_factory=dict)
    reference: Callable | None = None
    flops: Callable[..., float] | None = None

    @property
    def drawable(self) -> bool:
        """Whether its layer has ``program(x)`` (``ovqflex viz`` can draw it)."""
        return hasattr(self.layer, "program")

    @property
    def decodes(self) -> bool:
        """Whether its layer continues from a decode cache (``supports_cache``: it has a ``cache_type``)."""
        return self.layer.supports_cache

    @property
    def is_mixer(self) -> bool:
        return self.from_config is not None

    def option_names(self) -> set[str]:
        """The keyword options a user may give the layer (``fixed`` ones excluded)."""
        params = inspect.signature(self.layer).parameters.values()
        names = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
        if self.options is not None:
            names |= {f.name for f in fields(self.options)}
        return names - set(self.fixed)

    def build(self, hidden_size: int, num_heads: int, **options) -> nn.Module:
        """The method's layer for x ``[B, T, hidden_size]`` with ``num_heads`` heads. An option the
        layer does not take is a :class:`ConfigTypeError` naming the nearest one it does."""
        check_keys(f"method {self.name!r} options", options, self.option_names(), error=ConfigTypeError)
        return self.layer(hidden_size, num_heads, **self.fixed, **options)

    def example(self, heads: int, head_dim: int, options: dict | None = None, what: str = "") -> nn.Module:
        """The layer ``ovqflex viz`` draws and ``ovqflex profile`` runs: ``heads`` heads of ``head_dim``
        (hidden ``heads * head_dim``), options ``defaults`` updated by ``options``. A bad option (or
        ``head_dim``, which is the argument) is a ValueError naming ``what`` (default: the method)
        and the options."""
        opts = {**self.defaults, **(options or {})}
        what = what or f"method {self.name!r}"
        if "head_dim" in opts:
            raise ValueError(f"bad option for {what}: head_dim is set by the head dim argument, not an option")
        try:
            return self.build(heads * head_dim, heads, head_dim=head_dim, **opts)
        except ConfigError as e:
            raise ValueError(f"bad option for {what} (options {opts}): {e}") from None

    def mixer(self, config: HybridConfig) -> nn.Module:
        """The layer of a ``HybridLM`` block (width ``config.d_model``): the options the config sets,
        then ``config.mixer_options[name]``."""
        if self.from_config is None:
            raise ValueError(f"method {self.name!r} is not a HybridLM mixer")
        options = {**self.from_config(config), **config.mixer_options.get(self.name, {})}
        return self.build(config.d_model, config.n_heads, **options)


#: name -> :class:`Method`, in registration order; filled by :func:`register_method`
METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (a name may be registered once)."""
    if not isinstance(method, Method):
        raise TypeError(f"method must be a Method, got {type(method).__name__}")
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    if not (isinstance(method.layer, type) and issubclass(method.layer, AttentionLayer)):
        raise TypeError(f"method {method.name!r}: layer must be a subclass of ovqflex.AttentionLayer (the layer "
                        f"contract, docs/adding-a-method.md §7), got {method.layer!r}")
    unknown = set(method.fixed) - {p for p in inspect.signature(method.layer).parameters}
    if unknown:
        raise ValueError(f"method {method.name!r}: fixed options {sorted(unknown)} are not arguments of "
                         f"{method.layer.__name__}")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method ``name`` (ValueError listing the registered ones otherwise)."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    return METHODS[name]


def method_names(where: Callable[[Method], bool] = lambda m: True) -> list[str]:
    """Sorted names of the registered methods for which ``where(method)`` holds."""
    return sorted(name for name, m in METHODS.items() if where(m))


def _attention_options(c: HybridConfig) -> dict:
    """What every softmax mixer takes from the model config."""
    return dict(head_dim=c.head_dim, qk_conv=c.qk_conv, backend=c.backend, block_size=c.block_size)


def _beta_everywhere(layer) -> dict[str, Tensor]:
    return {name: layer.beta.detach() for name in ("sink", "state", "window", "causal")}


def _kvm_temperatures(layer) -> dict[str, Tensor | float]:
    return {"state": 1.0 if layer.tau_state is None else layer.tau_state.detach(),
            "window": 1.0 if layer.tau_bswa is None else layer.tau_bswa.detach()}


_SMALL = dict(backend="blocked", block_size=16)  # conformance tests: the eager CPU backend, small blocks

register_method(Method(
    "full", CausalAttention, "full causal attention (RoPE)", fixed=dict(rope=True),
    from_config=lambda c: dict(rope_base=c.rope_base, qk_norm=c.qk_norm, **_attention_options(c)),
    test_options=_SMALL))
register_method(Method(
    "nope", CausalAttention, "full causal attention without positions (NoPE)", fixed=dict(rope=False),
    from_config=lambda c: dict(qk_norm=c.qk_norm, **_attention_options(c)), test_options=_SMALL))
register_method(Method(
    "swa", SlidingWindowAttention, "token sliding window (RoPE)", fixed=dict(rope=True),
    # the config's window and the method's are defaults (sinks' too): a block_window option replaces them
    from_config=lambda c: dict(window=DefaultWindow(c.window), rope_base=c.rope_base, qk_norm=c.qk_norm,
                               **_attention_options(c)),
    defaults=dict(window=DefaultWindow(128)), test_options=dict(_SMALL, window=20)))
register_method(Method(
    "bswa", SlidingWindowAttention, "block sliding window of Nb chunks (RoPE)", fixed=dict(rope=True),
    from_config=lambda c: dict(block_window=c.n_bswa_chunks, chunk_size=c.chunk_size, rope_base=c.rope_base,
                               qk_norm=c.qk_norm, **_attention_options(c)),
    defaults=dict(block_window=2, chunk_size=128), test_options=dict(_SMALL, block_window=2, chunk_size=16)))
register_method(Method(
    "sinks", SlidingWindowAttention, "StreamingLLM: sinks + token window (RoPE)", fixed=dict(rope=True),
    defaults=dict(window=DefaultWindow(128), n_sinks=4), test_options=dict(_SMALL, window=20, n_sinks=2)))
register_method(Method(
    "ovq", OVQAttention, "OVQ-attention: per-chunk dictionary snapshot (log-count bias) + own chunk causal",
    options=OVQOptions,
    from_config=lambda c: dict(chunk_size=c.chunk_size, **_attention_options(c)),
    defaults=dict(chunk_size=128, max_centroids=256), temperatures=_beta_everywhere,
    test_options=dict(_SMALL, chunk_size=16, max_centroids=24),
    reference=ovq_attention_reference, flops=ovq_flops))
register_method(Method(
    "kvm", KVMAttention,
    "KVM: sinks + growable state (16 sqrt(ctx) rows) + Nb-chunk block window, region temperatures",
    options=KVMOptions,
    from_config=lambda c: dict(chunk_size=c.chunk_size, n_bswa_chunks=c.n_bswa_chunks, rope_base=c.rope_base,
                               **_attention_options(c)),
    defaults=dict(chunk_size=128, n_bswa_chunks=2, sink_len=1, budget="power_law", max_state_chunks=None),
    temperatures=_kvm_temperatures,
    test_options=dict(_SMALL, chunk_size=16, budget="power_law", growth_factor=4.0, max_state_chunks=None),
    reference=kvm_attention_reference, flops=kvm_flops))
register_method(Method(
    "vq", VQAttention,
    "VQ-attention: codebook per chunk (log-count bias, tokens of chunks < c-1) + chunks c-1, c causal",
    options=VQOptions,
    from_config=lambda c: dict(chunk_size=c.chunk_size, **_attention_options(c)),
    defaults=dict(chunk_size=128, codebook_size=256), temperatures=_beta_everywhere,
    test_options=dict(_SMALL, chunk_size=16, codebook_size=12, local_bias=True),
    reference=vq_attention_reference, flops=vq_flops))
register_method(Method(
    "longvq", LongVQBlock, "LongVQ block's VQ attention (local bias folded into the codebook rows' bias)",
    options=VQOptions,
    from_config=lambda c: dict(chunk_size=c.chunk_size, backend=c.backend, block_size=c.block_size,
                               norm_eps=c.norm_eps, head_dim=c.head_dim),
    defaults=dict(chunk_size=128, codebook_size=256), temperatures=_beta_everywhere,
    test_options=dict(_SMALL, chunk_size=16, codebook_size=12)))


def _recurrent_options(c: HybridConfig) -> dict:
    """Non-softmax recurrences: no backend or attention block; the q/k conv and head dim apply."""
    return dict(head_dim=c.head_dim, qk_conv=c.qk_conv)


register_method(Method("linear", LinearAttention, "linear attention (ELU+1 features)",
                       from_config=_recurrent_options, test_options=dict(chunk_size=16)))
register_method(Method("deltanet", DeltaNetAttention, "DeltaNet: the delta rule with a learned write strength",
                       from_config=_recurrent_options, test_options=dict(chunk_size=16)))
register_method(Method("vla", VLAAttention, "Variational Linear Attention (Sherman-Morrison penalty)",
                       options=VLAOptions, from_config=_recurrent_options, test_options=dict(refresh_every=12, chunk_size=4)))

