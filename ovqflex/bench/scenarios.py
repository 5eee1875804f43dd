"""Benchmark scenarios: each ``kind`` of a profile's ``[[scenario]]`` maps to a schema (a
dataclass: the keys its table may hold, their types and defaults) and a function taking the
parsed scenario and returning a list of result rows (dicts) measured in this process.

:func:`parse_scenario` turns a TOML table into its kind's schema: an unknown key is refused
by name with the nearest valid key suggested (``seq_len`` for ``seq_lens``), a missing
required key or a value of the wrong type is named too, all before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from masks.blocks import build_block_layout
from masks.regions import Geometry, OwnChunk, StateBank
from recurrences.checks import check_keys, from_dict

from ..methods import METHODS, Method, get_method, method_names
from .measure import measure


@dataclass(kw_only=True)
class Scenario:
    """Keys every scenario table has: ``kind``, ``name`` (default: the kind) and ``series``
    (scenarios sharing it are fitted as one series)."""

    kind: str
    name: str | None = None
    series: str | None = None


#: kind -> (schema, function); filled by :func:`register`
KINDS: dict[str, tuple[type[Scenario], Callable[[Scenario, str], list[dict]]]] = {}


def register(kind: str, schema: type[Scenario]):
    def add(fn):
        KINDS[kind] = (schema, fn)
        return fn
    return add


def parse_scenario(table: dict, where: str) -> Scenario:
    """A profile's ``[[scenario]]`` table -> its kind's schema (clear errors, see the module docstring)."""
    kind = table.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {sorted(KINDS)}, got {kind!r}")
    return from_dict(KINDS[kind][0], table, f"{where} (kind {kind!r})")


@dataclass(kw_only=True)
class BlockmaskScenario(Scenario):
    seq_len: int
    chunk_size: int
    state_rows: int           # rows of each chunk's bank
    block_size: int = 128
    with_q_side: bool = False  # also the backward's transposed lists
    repeats: int = 3


@register("blockmask", BlockmaskScenario)
def blockmask(sc: BlockmaskScenario, device: str) -> list[dict]:
    """Build the analytic block mask of a per-chunk state bank program (docs/design.md §3.2)."""
    T, C, N, blk, with_q = sc.seq_len, sc.chunk_size, sc.state_rows, sc.block_size, sc.with_q_side
    dev = torch.device(device)
    n_chunks = -(-T // C)
    live = torch.clamp(torch.arange(n_chunks, device=dev) * C * N // (torch.arange(n_chunks, device=dev) * C + N), max=N)
    geom = Geometry(T, T, -(-n_chunks * N // blk) * blk, T, blk, blk)
    regions = (StateBank(N, C, live), OwnChunk(C))

    def build():
        params = tuple(r.params(geom, dev) for r in regions)
        lay = build_block_layout(regions, params, geom)
        bm = lay.block_mask(lambda b, h, q, kv: q >= 0, with_q_side=with_q)
        return lay, bm

    m = measure(build, device=dev, repeats=sc.repeats)
    lay, bm = build()
    visible = int(lay.visible_blocks())
    total = geom.n_q_blocks * geom.n_kv_blocks
    return [{
        "scenario": sc.name or sc.kind,
        "T": T,
        "kv_rows": geom.kv_len,
        "q_side": with_q,
        "visible_blocks": visible,
        "block_sparsity": 1 - visible / total,
        "time_s": m.seconds,
        "peak_mb": m.peak_mb,
        "dense_mask_would_be_gb": T * geom.kv_len / 2**30,
    }]


def _compare(T: int, cases: list, dev: torch.device, repeats: int, peak_gflops: float) -> list[dict]:
    """Time ``cases`` (name, fn, model FLOPs) in this process; each row carries its speed-up
    over the ``"reference loop fwd"`` and ``"sdpa causal fwd"`` cases and its FLOP efficiency
    against the matmul rate measured on the spot."""
    results, failed, rows = {}, {}, []
    for name, fn, _ in cases:
        try:
            results[name] = measure(fn, device=dev, repeats=repeats)
        except Exception as e:  # a compile failure is a result to report, not a crash
            failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:60]}"
    for name, _, fl in cases:
        if name in failed:
            rows.append({"T": T, "case": name, "error": failed[name]})
            continue
        m = results[name]
        ref, sdpa = results.get("reference loop fwd"), results.get("sdpa causal fwd")
        rows.append({
            "T": T, "case": name, "time_s": m.seconds, "peak_mb": m.peak_mb,
            "x_vs_reference": ref.seconds / m.seconds if ref else None,
            "x_vs_sdpa": sdpa.seconds / m.seconds if sdpa else None,
            "gflops": fl / m.seconds / 1e9, "pct_matmul_peak": 100 * fl / m.seconds / 1e9 / peak_gflops,
        })
    return rows


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

    from .measure import matmul_gflops

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
        rows += _compare(T, cases, dev, repeats, peak)
    return rows


@dataclass(kw_only=True)
class OVQScenario(OpScenario):
    max_centroids: int


@register("ovq", OVQScenario)
def ovq(sc: OVQScenario, device: str) -> list[dict]:
    """OVQ op (docs/design.md §4.2) through :func:`_op_scenario`."""
    from ..ops.ovq import OVQOptions, ovq_attention

    options = dict(chunk_size=sc.chunk_size, max_centroids=sc.max_centroids)
    method = get_method("ovq")
    return _op_scenario(
        sc, device, method, op=ovq_attention,
        extra=lambda T, H, D, g, dev: {"beta": torch.full((H,), D**0.5, device=dev)}, options=options,
        flops=lambda T, H, D: method.flops(T, H, D, OVQOptions(**options)))


@dataclass(kw_only=True)
class TrainScenario(Scenario):
    patterns: list[str]          # the first is the baseline of x_vs_baseline
    seq_len: int
    preset: str = "tiny"
    batch_size: int = 8
    task: str = "icr"
    task_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)
    steps: int = 10              # timed steps
    warmup_steps: int = 3        # untimed, include compile
    compile: bool = True


@register("train", TrainScenario)
def train(sc: TrainScenario, device: str) -> list[dict]:
    """Training throughput of whole models: ``torch.compile(model)`` AdamW steps on a task's
    batches, for each mixer ``patterns`` entry."""
    import time

    from ..tasks import make_batch
    from ..training import TrainConfig
    from ..training.setup import autocast_dtype, build_model, build_optimizer, build_task
    from ..training.trainer import forward_loss

    dev = torch.device(device)
    steps, warm = sc.steps, sc.warmup_steps
    rows = []
    for pattern in sc.patterns:
        cfg = TrainConfig(task=sc.task, preset=sc.preset, pattern=pattern, seq_len=sc.seq_len,
                          batch_size=sc.batch_size, compile=sc.compile, model_options=dict(sc.model_options),
                          task_options=dict(sc.task_options))
        torch.manual_seed(0)
        task = build_task(cfg)
        model = build_model(cfg, task).to(dev)
        opt = build_optimizer(model, cfg)
        fwd = torch.compile(model) if cfg.compile else model
        amp = autocast_dtype(cfg, dev)

        def step(i):
            x, y = make_batch(task, seed=0, step=i, start=0, count=cfg.batch_size, seq_len=cfg.seq_len)
            x, y = x.to(dev), y.to(dev)
            forward_loss(fwd, x, y, amp)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        step(0)
        first = time.perf_counter() - t0
        for i in range(1, warm):
            step(i)
        m = measure(lambda: [step(warm + i) for i in range(steps)], device=dev, repeats=1, warmup=0)
        rows.append({"pattern": pattern, "T": cfg.seq_len, "batch": cfg.batch_size,
                     "params_m": model.num_parameters() / 1e6, "first_step_s": first,
                     "step_s": m.seconds / steps, "tokens_per_s": steps * cfg.batch_size * cfg.seq_len / m.seconds,
                     "peak_mb": m.peak_mb})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["x_vs_baseline"] = r["tokens_per_s"] / base
    return rows


@dataclass(kw_only=True)
class KVMScenario(OpScenario):
    """The budget keys are :func:`ovqflex.kvm_attention`'s options, with its defaults (TOML has
    no null: ``state_min_len = 0`` is the default one chunk, ``max_state_chunks = 0`` uncapped)."""

    n_bswa_chunks: int = 2
    sink_len: int = 1
    budget: str = "fixed"
    state_min_len: int = 0
    growth_factor: float = 16.0
    growth_exponent: float = 0.5
    round_down: int = 1
    saturation_n: int = 1024
    max_state_chunks: int = 1


@register("kvm", KVMScenario)
def kvm(sc: KVMScenario, device: str) -> list[dict]:
    """KVM op (docs/design.md §4.3) through :func:`_op_scenario`."""
    import functools

    import torch.nn.functional as F

    from ..ops.kvm import KVMOptions, kvm_attention

    options = dict(chunk_size=sc.chunk_size, n_bswa_chunks=sc.n_bswa_chunks, sink_len=sc.sink_len, budget=sc.budget,
                   state_min_len=sc.state_min_len or None, growth_factor=sc.growth_factor,
                   growth_exponent=sc.growth_exponent, round_down=sc.round_down, saturation_n=sc.saturation_n,
                   max_state_chunks=sc.max_state_chunks or None)
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
    from ..ops.vq import VQOptions, vq_attention

    N, method = sc.codebook_size, get_method("vq")
    options = dict(chunk_size=sc.chunk_size)

    def extra(T, H, D, g, dev):
        return {"codebook": torch.randn(H, N, D, generator=g).to(dev), "beta": torch.full((H,), D**0.5, device=dev)}

    return _op_scenario(sc, device, method, op=lambda **a: vq_attention(**a)[0], extra=extra, options=options,
                        flops=lambda T, H, D: method.flops(T, H, D, VQOptions(**options), codebook_size=N))


@dataclass(kw_only=True)
class VizScenario(Scenario):
    method: str                # a key of ovqflex.viz.VIZ_METHODS
    seq_lens: list[int]
    heads: int = 1
    head_dim: int = 16
    options: dict = field(default_factory=dict)  # layer options
    views: list[str] = field(default_factory=lambda: ["block"])
    repeats: int = 1


@register("viz", VizScenario)
def viz(sc: VizScenario, device: str) -> list[dict]:
    """The visualizer at scale: build a method's program (random input), then its block view
    (grid, statistics, PNG) — timed and memory-measured separately, for each ``seq_len``."""
    import tempfile

    from masks.viz import VizOptions, render

    from ..viz import VizShape, method_program

    method, repeats = sc.method, sc.repeats
    opts = VizOptions(views=tuple(sc.views), formats=("png",))
    rows = []
    for T in sc.seq_lens:
        shape = VizShape(seq_len=T, heads=sc.heads, head_dim=sc.head_dim)
        build = lambda: method_program(method, shape, dict(sc.options))[0]  # noqa: E731
        m_prog = measure(build, device=device, repeats=repeats, warmup=1)
        program = build()
        with tempfile.TemporaryDirectory() as tmp:
            m_view = measure(lambda: render(program, opts, tmp), device=device, repeats=repeats, warmup=0)
        g = program.geom
        for case, m in (("program (op, random input)", m_prog), (f"{'+'.join(opts.views)} view + PNG", m_view)):
            rows.append({"T": T, "case": case, "kv_rows": g.kv_len,
                         "blocks": f"{g.n_q_blocks}x{g.n_kv_blocks}", "time_s": m.seconds, "peak_mb": m.peak_mb})
    return rows


@dataclass(kw_only=True)
class RecurrentScenario(Scenario):
    seq_lens: list[int]
    heads: int = 4
    head_dim: int = 64
    batch: int = 1
    chunk_size: int = 64          # linear, DeltaNet
    vla_chunk: int = 20           # the refresh period
    max_centroids: int = 2048     # OVQ
    ovq_chunk: int = 128
    ovq_backend: str = "blocked"
    max_reference_len: int = 1024
    repeats: int = 3


@register("recurrent", RecurrentScenario)
def recurrent(sc: RecurrentScenario, device: str) -> list[dict]:
    """Non-softmax recurrences (linear attention, DeltaNet, VLA; docs/design.md §4.6): chunked op forward
    and forward+backward, their token-by-token reference loops (up to ``max_reference_len``),
    OVQ (``ovq_backend``, forward) and full causal SDPA, at each ``seq_len`` of ``seq_lens``.
    The runner fits the log-log slope of time and memory vs T of each case.
    """
    import torch.nn.functional as F

    from recurrences.reference import delta_rule_reference, linear_attention_reference, vla_reference

    from ..ops.linear import delta_rule, linear_attention, vla_attention
    from ..ops.ovq import ovq_attention

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
        cases = []
        for name, (op, args, ref) in ops.items():
            def fwd(op=op, args=args):
                with torch.no_grad():
                    return op(*args)

            grad_args = tuple(a.clone().requires_grad_() for a in args)

            def fwd_bwd(op=op, grad_args=grad_args):
                op(*grad_args).sum().backward()

            cases += [(f"{name} chunked fwd", fwd), (f"{name} chunked fwd+bwd", fwd_bwd)]
            if T <= max_ref:
                def reference(ref=ref):
                    with torch.no_grad():
                        return ref()
                cases.append((f"{name} reference loop fwd", reference))
        beta_ovq = torch.full((H,), D**0.5, device=dev)

        def ovq():
            with torch.no_grad():
                return ovq_attention(q, k, v, beta_ovq, chunk_size=Lo, max_centroids=N, backend=ovq_backend)

        def sdpa():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        cases += [(f"ovq {ovq_backend} fwd", ovq), ("sdpa causal fwd", sdpa)]
        results = {name: measure(fn, device=dev, repeats=repeats) for name, fn in cases}
        for name, m in results.items():
            ref = results.get(name.replace("chunked fwd", "reference loop fwd")) if "chunked fwd" in name else None
            rows.append({"T": T, "case": name, "time_s": m.seconds, "peak_mb": m.peak_mb,
                         "x_vs_sdpa": results["sdpa causal fwd"].seconds / m.seconds,
                         "x_vs_reference": ref.seconds / m.seconds if ref and name.endswith("fwd") else None})
    return rows


@dataclass(kw_only=True)
class StateLayoutScenario(Scenario):
    seq_lens: list[int]
    max_centroids: int = 2048
    heads: int = 2
    head_dim: int = 64
    chunk_size: int = 128
    growth: str = "plateau"
    layouts: list[str] = field(default_factory=lambda: ["snapshot", "versioned"])
    checkpoint_every: int = 0     # 0: the default
    backend: str = "blocked"
    backward: bool = True
    repeats: int = 2


@register("state_layout", StateLayoutScenario)
def state_layout(sc: StateLayoutScenario, device: str) -> list[dict]:
    """OVQ op under each state layout (docs/design.md §5): state rows, forward and forward+backward time and
    peak memory at each ``seq_len`` of ``seq_lens``; the runner fits the log-log slope of each case.
    ``x_time_vs_snapshot`` is the time ratio to the snapshot layout's same case (> 1: slower).
    """
    from ..ops.ovq import ovq_attention, ovq_program

    dev = torch.device(device)
    H, D = sc.heads, sc.head_dim
    L, N = sc.chunk_size, sc.max_centroids
    every = sc.checkpoint_every or None
    backend, repeats = sc.backend, sc.repeats
    options = dict(chunk_size=L, max_centroids=N, growth=sc.growth, checkpoint_every=every)
    rows: list[dict] = []
    for T in sc.seq_lens:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, T, D, generator=g).to(dev) for _ in range(3))
        beta = torch.full((H,), D**0.5, device=dev)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta)]
        base: dict[str, float] = {}
        for layout in sc.layouts:
            with torch.no_grad():
                n_state = ovq_program(q, k, v, beta, state_layout=layout, **options)[0].geom.n_state

            def fwd(layout=layout):
                with torch.no_grad():
                    return ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, **options)

            def fwd_bwd(layout=layout):
                ovq_attention(*leaves, backend=backend, state_layout=layout, **options).sum().backward()
                for x in leaves:
                    x.grad = None

            cases = [("fwd", fwd)] + ([("fwd+bwd", fwd_bwd)] if sc.backward else [])
            for what, fn in cases:
                m = measure(fn, device=dev, repeats=repeats)
                base.setdefault(what, m.seconds) if layout == "snapshot" else None
                rows.append({"T": T, "case": f"{layout} {backend} {what}", "state_rows": n_state,
                             "state_rows_per_T": n_state / T, "time_s": m.seconds, "peak_mb": m.peak_mb,
                             "x_time_vs_snapshot": m.seconds / base[what] if what in base else None})
    return rows


def _decode_method(case: dict, where: str) -> tuple[Method, dict]:
    """The method of a decode ``case`` table (``name``, ``kind``: a method that decodes, and the
    options of its layer, checked by name); returns (method, layer options)."""
    if not isinstance(case, dict) or not isinstance(case.get("name"), str):
        raise ValueError(f"{where}: must be a table with a string name, got {case!r}")
    decoding = method_names(_decodes)
    if case.get("kind") not in decoding:
        raise ValueError(f"{where}: kind must be one of {decoding}, got {case.get('kind')!r}")
    method = METHODS[case["kind"]]
    check_keys(f"{where} (a {method.layer.__name__})", case, method.option_names() - {"backend"} | {"name", "kind"})
    return method, {k: v for k, v in case.items() if k not in ("kind", "name")}


def _decodes(m: Method) -> bool:
    return m.decodes


@dataclass(kw_only=True)
class DecodeScenario(Scenario):
    seq_lens: list[int]
    cases: list[dict]             # tables: name, kind (a method that decodes) and its layer's options
    hidden: int = 256
    heads: int = 4
    decode_tokens: int = 64
    repeats: int = 2

    def __post_init__(self):
        if not self.cases:
            raise ValueError(f"scenario {self.name!r}: cases must list at least one [[scenario.cases]] table")
        for i, case in enumerate(self.cases):
            _decode_method(case, f"scenario {self.name!r}, case {i}")


@register("decode", DecodeScenario)
def decode(sc: DecodeScenario, device: str) -> list[dict]:
    """Streaming decode at long contexts: each layer ``case`` prefills ``T`` tokens (the
    fused forward, flex, no grad) and then decodes ``decode_tokens`` tokens one per call
    through its cache. Rows: decode tokens/s, seconds per token (``time_s``, whose slope vs
    T is ~0 for a bounded cache and ~1 for a growing KV cache), the cache's own bytes
    (``cache_mb``) and the RSS growth while decoding (``peak_mb``). The last case is the
    baseline of ``x_vs_<name>``.
    """
    import time

    dev = torch.device(device)
    hidden, heads, n_dec = sc.hidden, sc.heads, sc.decode_tokens
    rows = []
    for i, case in enumerate(sc.cases):
        torch.manual_seed(0)
        method, options = _decode_method(case, f"scenario {sc.name!r}, case {i}")
        if "backend" in method.option_names():
            options["backend"] = "flex"
        layer = method.build(hidden, heads, **options).to(dev).eval()
        for T in sc.seq_lens:
            x = torch.randn(1, T + n_dec, hidden, device=dev)
            with torch.no_grad():
                t0 = time.perf_counter()
                _, cache = layer(x[:, :T], use_cache=True)
                prefill = time.perf_counter() - t0

                def run():
                    c = cache
                    for i in range(n_dec):
                        _, c = layer(x[:, T + i:T + i + 1], cache=c)
                    return c

                m = measure(run, device=dev, repeats=sc.repeats, warmup=1)
                end = run()
            rows.append({"case": case["name"], "T": T, "prefill_s": prefill, "tokens_per_s": n_dec / m.seconds,
                         "time_s": m.seconds / n_dec, "cache_mb": end.nbytes() / 2**20,
                         "cache_mb_prefill": cache.nbytes() / 2**20, "peak_mb": m.peak_mb})
    by_t = {}
    for r in rows:
        by_t.setdefault(r["T"], []).append(r)
    base = sc.cases[-1]["name"]  # the last case is the baseline (full attention's KV cache)
    for rs in by_t.values():
        ref = next((r for r in rs if r["case"] == base), None)
        for r in rs:
            if ref is not None:
                r["x_vs_" + base] = r["tokens_per_s"] / ref["tokens_per_s"]
    return rows


@dataclass(kw_only=True)
class QuantizedScenario(Scenario):
    preset: str = "tiny"
    pattern: str = "swa,ovq"
    vocab_size: int = 256
    model_options: dict = field(default_factory=dict)
    prompt_len: int = 1024
    decode_tokens: int = 64
    repeats: int = 2


@register("quantized", QuantizedScenario)
def quantized(sc: QuantizedScenario, device: str) -> list[dict]:
    """A model's decode throughput and output agreement, fp32 vs torchao int8 weight-only.
    Rows: tokens/s, ``x_vs_fp32`` and ``rel_err_logits`` of the prompt's logits against the
    fp32 model (the stated tolerance is 2e-2).
    """
    import copy

    from ..models import HybridLM
    from ..models.config import preset
    from ..quantize import quantize_model

    dev = torch.device(device)
    cfg = preset(sc.preset, pattern=sc.pattern, vocab_size=sc.vocab_size, backend="flex", **sc.model_options)
    torch.manual_seed(0)
    fp32 = HybridLM(cfg).to(dev).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, sc.prompt_len), device=dev)
    n_dec = sc.decode_tokens
    rows, ref_logits = [], None
    for mode in ("none", "int8"):
        model = quantize_model(copy.deepcopy(fp32), mode)
        with torch.no_grad():
            logits = model(prompt)
            m = measure(lambda: model.generate(prompt, n_dec, temperature=0), device=dev,
                        repeats=sc.repeats, warmup=1)
        ref_logits = logits if ref_logits is None else ref_logits
        err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        rows.append({"case": "fp32" if mode == "none" else mode, "pattern": cfg.pattern,
                     "prompt": prompt.shape[1], "generate_s": m.seconds, "tokens_per_s": n_dec / m.seconds,
                     "rel_err_logits": err})
    for r in rows:
        r["x_vs_fp32"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows

