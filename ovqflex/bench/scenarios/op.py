"""Op scenarios: a method's fused op vs its reference loop vs causal SDPA, forward and
forward+backward, in fp32 or bf16, with FLOP efficiency."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from recurrences.checks import check_choice
from recurrences.versioned import STATE_LAYOUTS

from ...attention import training_backend
from ...methods import Method, get_method
from ..measure import compare_cases
from .base import ZERO_MEANS_DEFAULT, Scenario, register

#: an op scenario's ``dtype`` key -> the dtype of every floating input of its cases
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: an op scenario's ``compile_shapes`` key -> ``torch.compile``'s ``dynamic`` for its compiled cases: one
#: static graph per length, or torch's default (the second length compiles a graph with a symbolic length,
#: which the later ones reuse: docs/design.md §3.5)
COMPILE_SHAPES = {"static": False, "dynamic": None}


@dataclass(kw_only=True)
class OpScenario(Scenario):
    """Keys of every per-method op scenario (:func:`_op_scenario`). ``dtype``: every floating input
    (q, k, v and the method's own, as a model cast to that dtype holds them) in ``"fp32"`` or
    ``"bf16"``; the forward+backward cases run up to ``max_backward_len`` tokens, the reference
    loop up to ``max_reference_len`` (0: never). ``compile_shapes``: how the compiled cases compile
    (:data:`COMPILE_SHAPES`); with ``"dynamic"`` a row's ``graphs_first_call`` shows whether its length
    compiled anew. ``checkpoint_every``: the ops' ``checkpoint_every`` (0: their default spacing,
    ``recurrences.versioned.default_every``), to weigh one spacing against the default in one run."""

    seq_lens: list[int]
    heads: int = 4
    head_dim: int = 64
    chunk_size: int = 128
    dtype: str = "fp32"
    max_backward_len: int = field(default=1 << 30, metadata=ZERO_MEANS_DEFAULT)
    max_reference_len: int = field(default=1 << 30, metadata=ZERO_MEANS_DEFAULT)
    repeats: int = 3
    compile_shapes: str = "static"
    checkpoint_every: int = field(default=0, metadata=ZERO_MEANS_DEFAULT)

    def __post_init__(self):
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("compile_shapes", self.compile_shapes, COMPILE_SHAPES)
        check_method_options(self.kind, {**method_options(self.kind, self),
                                         "checkpoint_every": self.checkpoint_every or None})


def _baseline_of(name: str) -> str:
    """The SDPA case a case is compared with (``x_vs_sdpa``): the forward+backward one for a
    forward+backward case."""
    return "sdpa causal fwd+bwd" if "fwd+bwd" in name else "sdpa causal fwd"


def op_inputs(T: int, H: int, D: int, extra, device: torch.device, dtype: torch.dtype) -> dict:
    """An op's keyword inputs at length ``T``: q, k, v ``[1, H, T, D]`` and ``extra(T, H, D, generator,
    cpu)``'s, drawn on the CPU from seed 0 (the same values on every device), then moved to ``device``
    with every floating one in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    t = dict(zip("qkv", (torch.randn(1, H, T, D, generator=g) for _ in range(3))))
    t.update(extra(T, H, D, g, torch.device("cpu")))
    return {n: x.to(device, dtype) if x.is_floating_point() else x.to(device) for n, x in t.items()}


def ovq_extra(T, H, D, g, dev) -> dict:
    """OVQ's extra op inputs: ``beta [H]`` at ``sqrt(D)``."""
    return {"beta": torch.full((H,), D**0.5, device=dev)}


def kvm_extra(T, H, D, g, dev) -> dict:
    """KVM's extra op inputs: a positive gate ``[1, H, T]``, identity ``LN_s`` and temperatures."""
    import torch.nn.functional as F

    return dict(gate=(1 + F.elu(torch.randn(1, H, T, generator=g))).to(dev),
                ln_s_weight=torch.ones(D, device=dev), ln_s_bias=torch.zeros(D, device=dev),
                tau_state=torch.ones(H, device=dev), tau_bswa=torch.ones(H, device=dev))


def vq_extra(codebook_size: int):
    """VQ's extra op inputs: a random codebook ``[H, codebook_size, D]`` and ``beta [H]`` at ``sqrt(D)``."""
    def extra(T, H, D, g, dev) -> dict:
        return {"codebook": torch.randn(H, codebook_size, D, generator=g).to(dev),
                "beta": torch.full((H,), D**0.5, device=dev)}
    return extra


def _op_scenario(sc: OpScenario, device: str, method: Method, *, op, extra, options: dict, flops) -> list[dict]:
    """Shared driver of the per-method op scenarios, at each ``seq_len`` of ``seq_lens``: the fused op
    (flex forward compiled and eager; forward+backward compiled and eager through the backend that
    trains on the device: flex on CUDA, blocked on the CPU) vs the method's sequential
    ``reference`` loop vs causal SDPA (forward, and forward+backward for the backward cases:
    ``x_vs_sdpa`` compares like with like). Inputs ``[1, heads, T, head_dim]`` in ``sc.dtype``.

    ``op(q=, k=, v=, **extra, backend=, **options)`` and ``method.reference(...)`` take the same
    keyword tensors; ``extra(T, H, D, generator, device)`` makes the method's extra inputs;
    ``flops(T, H, D)`` its model FLOPs (forward; a backward counts twice that). The op also gets the
    scenario's ``checkpoint_every`` when set (a layout option: the reference has none).
    """
    import torch.nn.functional as F

    from ..measure import matmul_gflops

    reference_options = options
    if sc.checkpoint_every:
        options = dict(options, checkpoint_every=sc.checkpoint_every)
    dev, dtype = torch.device(device), DTYPES[sc.dtype]
    H, D = sc.heads, sc.head_dim
    repeats, peak = sc.repeats, matmul_gflops(dev)
    trains = training_backend(dev)
    rows = []
    # compiled once for every length, so that with dynamic shapes the later lengths meet the graphs of the first
    compiled = {backend: torch.compile(lambda inputs, b=backend: op(**inputs, backend=b, **options),
                                       fullgraph=True, dynamic=COMPILE_SHAPES[sc.compile_shapes])
                for backend in {"flex", trains}}
    for T in sc.seq_lens:
        t = op_inputs(T, H, D, extra, dev, dtype)
        grad_t = {n: x.clone().requires_grad_(x.is_floating_point()) for n, x in t.items()}
        sdpa_grad = [grad_t[n].detach().clone().requires_grad_() for n in "qkv"]

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    return fn()
            return run

        fl, sdpa_fl = flops(T, H, D), 4.0 * H * D * T * (T + 1) / 2
        cases = [("fused flex fwd, compiled op", no_grad(lambda: compiled["flex"](t)), fl),
                 ("fused flex fwd, eager op", no_grad(lambda: op(**t, backend="flex", **options)), fl),
                 ("sdpa causal fwd", no_grad(lambda: F.scaled_dot_product_attention(t["q"], t["k"], t["v"],
                                                                                    is_causal=True)), sdpa_fl)]
        if T <= sc.max_reference_len:
            cases.append(("reference loop fwd", no_grad(lambda: method.reference(**t, **reference_options).out), fl))
        if T <= sc.max_backward_len:
            cases += [(f"fused {trains} fwd+bwd, compiled op", lambda: compiled[trains](grad_t).sum().backward(),
                       3 * fl),
                      (f"fused {trains} fwd+bwd, eager op",
                       lambda: op(**grad_t, backend=trains, **options).sum().backward(), 3 * fl),
                      ("sdpa causal fwd+bwd",
                       lambda: F.scaled_dot_product_attention(*sdpa_grad, is_causal=True).sum().backward(),
                       3 * sdpa_fl)]
        rows += compare_cases(T, cases, dev, repeats, peak_gflops=peak, baseline_of=_baseline_of,
                              reference_of=lambda name: None if "fwd+bwd" in name else "reference loop fwd")
        for row in rows[-len(cases):]:
            row.update(dtype=sc.dtype, compile_shapes=sc.compile_shapes, checkpoint_every=sc.checkpoint_every or None)
    return rows


@dataclass(kw_only=True)
class OVQScenario(OpScenario):
    max_centroids: int


@register("ovq", OVQScenario)
def ovq(sc: OVQScenario, device: str) -> list[dict]:
    """OVQ op (docs/design.md §4.2) through :func:`_op_scenario`."""
    from ...ops.ovq import OVQOptions, ovq_attention

    options = method_options("ovq", sc)
    method = get_method("ovq")
    return _op_scenario(
        sc, device, method, op=ovq_attention, extra=ovq_extra, options=options,
        flops=lambda T, H, D: method.flops(T, H, D, OVQOptions(**options)))


@dataclass(kw_only=True)
class KVMStateKeys:
    """The KVM keys of a scenario: :func:`ovqflex.kvm_attention`'s window, sink and budget options,
    with its defaults (TOML has no null: ``state_min_len = 0`` is the default one chunk,
    ``max_state_chunks = 0`` uncapped)."""

    n_bswa_chunks: int = 2
    sink_len: int = field(default=1, metadata=ZERO_MEANS_DEFAULT)
    budget: str = "fixed"
    state_min_len: int = field(default=0, metadata=ZERO_MEANS_DEFAULT)
    growth_factor: float = 16.0
    growth_exponent: float = 0.5
    round_down: int = 1
    saturation_n: int = 1024
    max_state_chunks: int = field(default=1, metadata=ZERO_MEANS_DEFAULT)

    def kvm_options(self, chunk_size: int) -> dict:
        """The :class:`~ovqflex.ops.kvm.KVMOptions` keywords of these keys and ``chunk_size``."""
        return dict(chunk_size=chunk_size, n_bswa_chunks=self.n_bswa_chunks, sink_len=self.sink_len,
                    budget=self.budget, state_min_len=self.state_min_len or None, growth_factor=self.growth_factor,
                    growth_exponent=self.growth_exponent, round_down=self.round_down,
                    saturation_n=self.saturation_n, max_state_chunks=self.max_state_chunks or None)


STATE_METHODS = ("ovq", "kvm", "vq")


#: the keys of a scenario that one method alone reads (:func:`method_options`)
METHOD_KEYS = {"ovq": ("max_centroids",), "kvm": tuple(f.name for f in dataclasses.fields(KVMStateKeys)),
               "vq": ("codebook_size",)}


def method_options(method: str, keys) -> dict:
    """The op keyword options of ``method`` (one of :data:`STATE_METHODS`) from a scenario's keys: its
    ``chunk_size``, OVQ's ``max_centroids``, KVM's keys (:class:`KVMStateKeys`). A key another method
    alone reads (:data:`METHOD_KEYS`), given a value other than its default, is refused: it would be
    ignored (``budget = "power_law"`` in a scenario of method ``"ovq"`` had timed the plain OVQ op)."""
    defaults = {f.name: f.default for f in dataclasses.fields(keys)}
    for other, names in METHOD_KEYS.items():
        for name in names:
            if other != method and name in defaults and getattr(keys, name) != defaults[name]:
                raise ValueError(f"{name} = {getattr(keys, name)!r} is read by method {other!r} alone; "
                                 f"this scenario's method is {method!r}")
    if method == "ovq":
        return dict(chunk_size=keys.chunk_size, max_centroids=keys.max_centroids)
    if method == "kvm":
        return keys.kvm_options(keys.chunk_size)
    return dict(chunk_size=keys.chunk_size)


def check_method_options(method: str, options: dict) -> None:
    """``options`` through ``method``'s options dataclass, which refuses a bad one by name: a scenario's
    ``__post_init__`` calls this with the options its function will run, so the profile is refused when it
    loads (a ``chunk_size`` of 100 had been found when its scenario started, after the ones before it ran)."""
    get_method(method).options(**options)


@dataclass(kw_only=True)
class StateMethodKeys(KVMStateKeys):
    """The keys of a scenario that runs one of the stateful ops on each of its state ``layouts``: ``method``, one
    of :data:`STATE_METHODS` (OVQ reads ``max_centroids``, KVM the keys of :class:`KVMStateKeys`, VQ
    ``codebook_size``), and ``chunk_size``."""

    method: str = "ovq"
    max_centroids: int = 2048
    codebook_size: int = 512
    chunk_size: int = 128
    layouts: list[str] = field(default_factory=lambda: ["snapshot", "versioned"])

    def __post_init__(self):
        check_choice("method", self.method, STATE_METHODS)
        for i, layout in enumerate(self.layouts):
            check_choice(f"layouts[{i}]", layout, STATE_LAYOUTS[:2])
        check_method_options(self.method, self.op_options())

    def op_options(self) -> dict:
        """The options the scenario's function runs its op with (checked when the profile loads): the
        method's (:func:`method_options`); a kind with more keys adds them."""
        return method_options(self.method, self)

    def method_parts(self) -> tuple:
        """``(program, op, extra, options)``: ``program(**inputs, **options)[0]`` is the op's attention program,
        ``op(**inputs, backend=, **options)`` its output, ``extra`` draws its inputs beside q, k, v
        (:func:`op_inputs`)."""
        from ...ops import kvm_attention, kvm_program, ovq_attention, ovq_program, vq_attention, vq_program

        options = method_options(self.method, self)
        if self.method == "ovq":
            return ovq_program, ovq_attention, ovq_extra, options
        if self.method == "kvm":
            return kvm_program, kvm_attention, kvm_extra, options
        return vq_program, lambda **a: vq_attention(**a)[0], vq_extra(self.codebook_size), options


@dataclass(kw_only=True)
class KVMScenario(OpScenario, KVMStateKeys):
    """An op scenario with the KVM keys (:class:`KVMStateKeys`)."""


@register("kvm", KVMScenario)
def kvm(sc: KVMScenario, device: str) -> list[dict]:
    """KVM op (docs/design.md §4.3) through :func:`_op_scenario`."""
    import functools

    from ...ops.kvm import KVMOptions, kvm_attention

    options = method_options("kvm", sc)
    opts, method = KVMOptions(**options), get_method("kvm")
    sizes = functools.cache(opts.state_sizes)  # state rows of each chunk at length T
    rows = _op_scenario(sc, device, method, op=kvm_attention, extra=kvm_extra, options=options,
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
    options = method_options("vq", sc)
    return _op_scenario(sc, device, method, op=lambda **a: vq_attention(**a)[0], extra=vq_extra(N), options=options,
                        flops=lambda T, H, D: method.flops(T, H, D, VQOptions(**options), codebook_size=N))
