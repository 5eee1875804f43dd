"""The non-softmax recurrences vs their loops, OVQ and SDPA (``recurrent``); a stateful op's state layouts
(``state_layout``) and OVQ's and KVM's routing implementations (``routing``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from masks.program import DEFAULT_BLOCK
from recurrences.checks import check_choice

from ...attention import BACKENDS
from ..measure import compare_cases, measure, relative_error, saved_for_backward_mb
from .base import ZERO_MEANS_DEFAULT, Scenario, register
from .op import KVMStateKeys, StateMethodKeys, check_method_options, method_options, op_inputs


@dataclass(kw_only=True)
class RecurrentScenario(Scenario):
    seq_lens: list[int]
    heads: int = 4
    head_dim: int = 64
    batch: int = 1
    chunk_size: int = 64          # linear, DeltaNet
    vla_chunk: int = 20           # VLA's chunk: divides its refresh period (20 tokens)
    max_centroids: int = 2048     # OVQ
    ovq_chunk: int = 128
    ovq_backend: str = "blocked"
    ovq: bool = True              # the OVQ baseline (slow on a CPU at long T)
    max_reference_len: int = field(default=1024, metadata=ZERO_MEANS_DEFAULT)
    other_chunk_form: bool = False
    repeats: int = 3

    def __post_init__(self):
        from recurrences.vla import VLAOptions

        VLAOptions(chunk_size=self.vla_chunk)
        if self.ovq:
            check_choice("ovq_backend", self.ovq_backend, BACKENDS)
            check_method_options("ovq", dict(chunk_size=self.ovq_chunk, max_centroids=self.max_centroids))


@register("recurrent", RecurrentScenario)
def recurrent(sc: RecurrentScenario, device: str) -> list[dict]:
    """Non-softmax recurrences (linear attention, DeltaNet, VLA; docs/design.md §4.6): chunked op forward
    and forward+backward, their token-by-token reference loops (up to ``max_reference_len``),
    OVQ (``ovq_backend``, forward; unless ``ovq = false``) and full causal SDPA, at each ``seq_len`` of
    ``seq_lens``. ``other_chunk_form``: also DeltaNet and VLA with their chunks run the way the device's
    default does not (``recurrences.delta.delta_chunks``: the blocked scan on a CPU, the loop on a GPU),
    named ``deltanet blocked ...`` or ``deltanet loop ...``, whose ``x_vs_reference`` is their speed-up
    over the default form. Where the reference loop ran, each chunked forward row (either form) also has
    ``rel_err_vs_reference``: its last output against the loop's, ``|out - ref| / |ref|``. The runner fits
    the log-log slope of time and memory vs T of each case.
    """
    from recurrences.delta import delta_rule_chunked
    from recurrences.reference import delta_rule_reference, linear_attention_reference, vla_reference
    from recurrences.vla import VLAOptions, vla_chunked

    from ...ops.linear import delta_rule, linear_attention, vla_attention
    from ...ops.ovq import ovq_attention

    dev = torch.device(device)
    B, H, D = sc.batch, sc.heads, sc.head_dim
    C, Cv = sc.chunk_size, sc.vla_chunk
    N, Lo, ovq_backend = sc.max_centroids, sc.ovq_chunk, sc.ovq_backend
    repeats, max_ref = sc.repeats, sc.max_reference_len
    rows: list[dict] = []
    for T in sc.seq_lens:
        g = torch.Generator().manual_seed(0)
        q, k, v, u = (torch.randn(B, H, T, D, generator=g).to(dev) for _ in range(4))
        kn, beta = F.normalize(k, dim=-1), torch.rand(B, H, T, generator=g).to(dev)
        ops = {
            "linear": (lambda *a: linear_attention(*a, chunk_size=C), (q, k, v),
                       lambda: linear_attention_reference(q, k, v)),
            "deltanet": (lambda *a: delta_rule(*a, chunk_size=C), (q, kn, v, beta),
                         lambda: delta_rule_reference(q, kn, v, beta)),
            "vla": (lambda *a: vla_attention(*a, chunk_size=Cv), (q, k, v, u), lambda: vla_reference(q, k, v, u)),
        }
        if sc.other_chunk_form:
            blocked = dev.type == "cpu"           # what delta_chunks does not pick by default here
            form = "blocked" if blocked else "loop"
            ops[f"deltanet {form}"] = (lambda *a: delta_rule_chunked(*a, chunk_size=C, blocked=blocked),
                                       (q, kn, v, beta), None)
            ops[f"vla {form}"] = (lambda *a: vla_chunked(*a, VLAOptions(chunk_size=Cv), blocked=blocked),
                                  (q, k, v, u), None)
        cases, outputs = [], {}  # the last output of each forward case (kept while it runs again)
        for name, (op, args, ref) in ops.items():
            def fwd(op=op, args=args, name=f"{name} chunked fwd"):
                with torch.no_grad():
                    outputs[name] = op(*args)

            grad_args = tuple(a.clone().requires_grad_() for a in args)

            def fwd_bwd(op=op, grad_args=grad_args):
                op(*grad_args).sum().backward()

            cases += [(f"{name} chunked fwd", fwd), (f"{name} chunked fwd+bwd", fwd_bwd)]
            if ref is not None and T <= max_ref:
                def reference(ref=ref, name=f"{name} reference loop fwd"):
                    with torch.no_grad():
                        outputs[name] = ref().out
                cases.append((f"{name} reference loop fwd", reference))
        beta_ovq = torch.full((H,), D**0.5, device=dev)

        def ovq():
            with torch.no_grad():
                return ovq_attention(q, k, v, beta_ovq, chunk_size=Lo, max_centroids=N, backend=ovq_backend)

        def sdpa():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        cases += ([(f"ovq {ovq_backend} fwd", ovq)] if sc.ovq else []) + [("sdpa causal fwd", sdpa)]
        rows += [_with_error(row, outputs) for row in compare_cases(T, cases, dev, repeats,
                                                                     reference_of=_reference_case)]
    return rows


def _with_error(row: dict, outputs: dict) -> dict:
    """``row`` of a chunked forward case with ``rel_err_vs_reference``: its last output (``outputs`` by case
    name) against its op's reference loop's, where both ran."""
    name = row["case"]
    if name.endswith(" chunked fwd"):
        loop = name.split(" ", 1)[0] + " reference loop fwd"
        if name in outputs and loop in outputs:
            row["rel_err_vs_reference"] = relative_error(outputs[name], outputs[loop])
    return row


def _reference_case(name: str) -> str | None:
    """``"linear chunked fwd"`` -> ``"linear reference loop fwd"`` (forward cases only); a case of the
    other chunk form -> the device default's: ``"deltanet blocked chunked fwd+bwd"`` -> ``"deltanet chunked
    fwd+bwd"``, so its ``x_vs_reference`` is its speed-up over the default."""
    for form in (" blocked chunked", " loop chunked"):
        if form in name:
            return name.replace(form, " chunked")
    return name.replace("chunked fwd", "reference loop fwd") if name.endswith("chunked fwd") else None


@dataclass(kw_only=True)
class StateLayoutScenario(Scenario, StateMethodKeys):
    """The method keys of :class:`~ovqflex.bench.scenarios.op.StateMethodKeys` (OVQ also ``growth``); inputs
    ``[1, heads, T, head_dim]`` fp32, drawn as the op scenarios draw them; the op runs on ``backend`` with each
    of ``layouts``, ``block_size`` its attention block, ``checkpoint_every`` its spacing (0: the default)."""

    seq_lens: list[int]
    heads: int = 2
    head_dim: int = 64
    block_size: int = DEFAULT_BLOCK
    growth: str = "plateau"
    checkpoint_every: int = field(default=0, metadata=ZERO_MEANS_DEFAULT)
    backend: str = "blocked"
    backward: bool = True
    repeats: int = 2

    def __post_init__(self):
        super().__post_init__()
        check_choice("backend", self.backend, BACKENDS)

    def op_options(self) -> dict:
        """The op's options: the method's, ``block_size``, ``checkpoint_every`` and OVQ's ``growth``."""
        options = dict(super().op_options(), block_size=self.block_size, checkpoint_every=self.checkpoint_every or None)
        if self.method == "ovq":
            options["growth"] = self.growth
        return options


@register("state_layout", StateLayoutScenario)
def state_layout(sc: StateLayoutScenario, device: str) -> list[dict]:
    """A stateful op under each state layout (docs/design.md §5) at each ``seq_len`` of ``seq_lens``: its state
    rows, the width of its block lists (``listed_width``: the blocks every query block lists at most, what the
    ``blocked`` backend gathers for each), forward and forward+backward time and peak memory, and for the
    forward+backward what autograd keeps for the backward (``saved_mb``:
    :func:`~ovqflex.bench.measure.saved_for_backward_mb`, what each such layer adds to a model's training
    peak); the runner fits the log-log slope of each case. ``x_time_vs_snapshot`` and ``x_saved_vs_snapshot``
    are ratios to the snapshot layout's same case (> 1: slower, more kept), in whichever order ``layouts``
    lists the layouts (None without the snapshot layout).
    """
    program_of, op, extra, _ = sc.method_parts()
    options = sc.op_options()
    dev, backend, repeats = torch.device(device), sc.backend, sc.repeats
    rows: list[dict] = []
    for T in sc.seq_lens:
        t = op_inputs(T, sc.heads, sc.head_dim, extra, dev, torch.float32)
        leaves = {n: x.clone().requires_grad_(x.is_floating_point()) for n, x in t.items()}
        by_layout: dict[tuple[str, str], dict] = {}
        for layout in sc.layouts:
            with torch.no_grad():
                program = program_of(**t, state_layout=layout, **options)[0]
            n_state, width = program.geom.n_state, program.layout.kv_idx.shape[-1]
            del program

            def fwd(layout=layout):
                with torch.no_grad():
                    return op(**t, backend=backend, state_layout=layout, **options)

            def fwd_bwd(layout=layout):
                op(**leaves, backend=backend, state_layout=layout, **options).sum().backward()
                for x in leaves.values():
                    x.grad = None

            cases = [("fwd", fwd)] + ([("fwd+bwd", fwd_bwd)] if sc.backward else [])
            for what, fn in cases:
                m = measure(fn, device=dev, repeats=repeats)
                row = {"T": T, "case": f"{layout} {backend} {what}", "state_rows": n_state,
                       "state_rows_per_T": n_state / T, "listed_width": width, "time_s": m.seconds,
                       "peak_mb": m.peak_mb}
                if what == "fwd+bwd":
                    row["saved_mb"] = saved_for_backward_mb(
                        lambda layout=layout: op(**leaves, backend=backend, state_layout=layout, **options),
                        leaves.values())
                by_layout[layout, what] = row
        for (_, what), row in by_layout.items():
            ref = by_layout.get(("snapshot", what))
            row["x_time_vs_snapshot"] = row["time_s"] / ref["time_s"] if ref else None
            if "saved_mb" in row:
                row["x_saved_vs_snapshot"] = row["saved_mb"] / ref["saved_mb"] if ref else None
        rows += by_layout.values()
    return rows


ROUTING_METHODS = ("ovq", "kvm")


@dataclass(kw_only=True)
class RoutingScenario(Scenario, KVMStateKeys):
    """``method``: ``"ovq"`` (``max_centroids``, plateau growth) or ``"kvm"`` (the KVM keys of
    :class:`~ovqflex.bench.scenarios.op.KVMStateKeys`); the shape keys serve both."""

    seq_lens: list[int]
    method: str = "ovq"
    max_centroids: int = 2048
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    chunk_size: int = 128
    repeats: int = 3

    def __post_init__(self):
        check_choice("method", self.method, ROUTING_METHODS)
        check_method_options(self.method, method_options(self.method, self))


@register("routing", RoutingScenario)
def routing(sc: RoutingScenario, device: str) -> list[dict]:
    """Routing alone (docs/design.md §4.2, §4.3) of ``method``: the chunk loop (``route_ovq``,
    ``route_kvm``) vs the compiled static-shape step (``StaticOVQRouter``, ``StaticKVMRouter``), and on
    CUDA that run captured in one CUDA graph, at each ``seq_len`` of ``seq_lens``. ``x_vs_reference``:
    speed-up over the loop; ``same_routes``: routes (and KVM's founders) equal to the loop's. The
    first call (compile, capture) is outside the timing.
    """
    dev = torch.device(device)
    rows: list[dict] = []
    for T in sc.seq_lens:
        g = torch.Generator().manual_seed(0)
        cases = (_ovq_routings if sc.method == "ovq" else _kvm_routings)(sc, T, g, dev)
        loop = cases["loop"]()
        timed = compare_cases(T, list(cases.items()), dev, sc.repeats, reference_of=lambda name: "loop")
        rows += [{**row, "same_routes": "error" not in row and all(map(torch.equal, cases[row["case"]](), loop))}
                 for row in timed]
    return rows


def _static_routers(make, dev: torch.device, module) -> dict:
    """``make(cuda_graph=...)``, a static router: compiled, and on CUDA also captured in a CUDA graph; where
    the device's compiled step fuses its absorb (``module.FUSED_ABSORB``: the method's routing_static
    module), that graph again with the opaque absorb (the choice's baseline, in the same process; the
    step compiles once more for it: dynamo guards on the flag)."""
    routers = {"static compiled": make(cuda_graph=False)}
    if dev.type == "cuda":
        routers["static cuda graph"] = make(cuda_graph=True)
        fused = module.FUSED_ABSORB.get(dev.type, False)
        if fused:
            module.FUSED_ABSORB[dev.type] = False
            try:  # a graph router compiles and captures its step when it is made
                routers["static cuda graph, opaque absorb"] = make(cuda_graph=True)
            finally:
                module.FUSED_ABSORB[dev.type] = fused
    return routers


def _ovq_routings(sc: RoutingScenario, T: int, g: torch.Generator, dev: torch.device) -> dict:
    """OVQ routing cases: name -> a call returning ``(routes,)``, of unit keys ``[B, H, T, D]``."""
    from recurrences.ovq import DictionarySchedule, route_ovq, routing_static
    from recurrences.ovq.routing_static import StaticOVQRouter

    L = sc.chunk_size
    k = F.normalize(torch.randn(sc.batch, sc.heads, T, sc.head_dim, generator=g), dim=-1).to(dev)
    schedule = DictionarySchedule(L, sc.max_centroids)
    routers = _static_routers(lambda cuda_graph: StaticOVQRouter(tuple(k.shape), chunk_size=L,
                                                                 sizes=schedule.sizes(-(-T // L)), device=dev,
                                                                 cuda_graph=cuda_graph), dev, routing_static)
    return {"loop": lambda: (route_ovq(k, schedule=schedule, impl="loop"),),
            **{name: lambda r=r: (r(k),) for name, r in routers.items()}}


def _kvm_routings(sc: RoutingScenario, T: int, g: torch.Generator, dev: torch.device) -> dict:
    """KVM routing cases: name -> a call returning ``(routes, founder)``, of memory keys ``LN(x)``
    ``[B, H, T, D]``, gates ``1 + elu(x)`` and ``LN_s`` at its initialisation (weight 1, bias 0)."""
    from recurrences.kvm import route_kvm, routing_static
    from recurrences.kvm.routing_static import StaticKVMRouter

    from ...ops.kvm import KVMOptions

    B, H, D = sc.batch, sc.heads, sc.head_dim
    o = KVMOptions(**sc.kvm_options(sc.chunk_size))
    kbar = F.layer_norm(torch.randn(B, H, T, D, generator=g), (D,)).to(dev)
    gate = (1 + F.elu(torch.randn(B, H, T, generator=g))).to(dev)
    ln = (torch.ones(D, device=dev), torch.zeros(D, device=dev))
    kw = dict(sink_len=o.sink_len, ln_eps=o.ln_eps)
    routers = _static_routers(lambda cuda_graph: StaticKVMRouter(
        tuple(kbar.shape), chunk_size=o.chunk_size, n_bswa_chunks=o.n_bswa_chunks, sizes=o.state_sizes(T), **kw,
        device=dev, cuda_graph=cuda_graph), dev, routing_static)
    return {"loop": lambda: route_kvm(kbar, gate, *ln, schedule=o.schedule, impl="loop", **kw),
            **{name: lambda r=r: r(kbar, gate, *ln) for name, r in routers.items()}}
