"""Benchmark scenarios: each ``kind`` of a profile's ``[[scenario]]`` maps to a function
returning a list of result rows (dicts) measured in this process."""
from __future__ import annotations

import torch

from masks.blocks import build_block_layout
from masks.regions import Geometry, OwnChunk, StateBank

from .measure import measure


def blockmask(sc: dict, device: str) -> list[dict]:
    """Build the analytic block mask of a per-chunk state bank program (SPEC §3.2).

    Keys: ``seq_len``, ``chunk_size``, ``state_rows`` (rows of each chunk's bank),
    ``block_size`` (128), ``with_q_side`` (also the backward's transposed lists).
    """
    T, C, N = int(sc["seq_len"]), int(sc["chunk_size"]), int(sc["state_rows"])
    blk = int(sc.get("block_size", 128))
    with_q = bool(sc.get("with_q_side", False))
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

    m = measure(build, device=dev, repeats=int(sc.get("repeats", 3)))
    lay, bm = build()
    visible = int(lay.visible_blocks())
    total = geom.n_q_blocks * geom.n_kv_blocks
    return [{
        "scenario": sc.get("name", "blockmask"),
        "T": T,
        "kv_rows": geom.kv_len,
        "q_side": with_q,
        "visible_blocks": visible,
        "block_sparsity": 1 - visible / total,
        "time_s": m.seconds,
        "peak_mb": m.peak_mb,
        "dense_mask_would_be_gb": T * geom.kv_len / 2**30,
    }]


KINDS = {"blockmask": blockmask}


def _ovq_flops(T: int, H: int, D: int, L: int, sizes: list[int], B: int = 1) -> float:
    """Model FLOPs of OVQ attention: per chunk, QK^T and PV over its dictionary rows plus
    the causal half of its own chunk (2 matmuls x 2 FLOPs per multiply-add)."""
    total = 0
    for c in range(-(-T // L)):
        lq = min(L, T - c * L)
        total += lq * sizes[c] + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total


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


def _op_scenario(sc: dict, device: str, *, op, reference, extra, options: dict, flops) -> list[dict]:
    """Shared driver of the per-method op scenarios, at each ``seq_len`` of ``seq_lens``:
    the fused op (flex forward, compiled and eager; blocked forward+backward up to
    ``max_backward_len``) vs the method's sequential ``reference`` loop vs causal SDPA.

    ``op(q=, k=, v=, **extra, backend=, **options)`` and ``reference(...)`` take the same
    keyword tensors; ``extra(T, H, D, generator, device)`` makes the method's extra inputs;
    ``flops(T, H, D)`` its model FLOPs.
    """
    import torch.nn.functional as F

    from .measure import matmul_gflops

    dev = torch.device(device)
    H, D = int(sc.get("heads", 4)), int(sc.get("head_dim", 64))
    repeats, peak = int(sc.get("repeats", 3)), matmul_gflops(dev)
    rows = []
    for T in sc["seq_lens"]:
        g = torch.Generator().manual_seed(0)
        t = dict(zip("qkv", (torch.randn(1, H, T, D, generator=g).to(dev) for _ in range(3))))
        t.update(extra(T, H, D, g, dev))
        grad_t = {n: x.clone().requires_grad_() for n, x in t.items()}
        # dynamic=False: a second length would otherwise trace dynamic shapes, which CPU flex
        # codegen rejects (SPEC §11)
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
                 ("reference loop fwd", no_grad(lambda: reference(**t, **options)), fl),
                 ("sdpa causal fwd", no_grad(lambda: F.scaled_dot_product_attention(t["q"], t["k"], t["v"],
                                                                                    is_causal=True)),
                  4.0 * H * D * T * (T + 1) / 2)]
        if T <= int(sc.get("max_backward_len", 1 << 30)):
            cases.append(("fused blocked fwd+bwd",
                          lambda: op(**grad_t, backend="blocked", **options).sum().backward(), 3 * fl))
        rows += _compare(T, cases, dev, repeats, peak)
    return rows


def ovq(sc: dict, device: str) -> list[dict]:
    """OVQ op (SPEC §4.2) through :func:`_op_scenario`. Keys: ``max_centroids``, ``heads``,
    ``head_dim``, ``chunk_size``, ``max_backward_len``, ``repeats``."""
    from recurrences.ovq import dictionary_sizes
    from recurrences.reference import ovq_attention_reference

    from ..ops.ovq import ovq_attention

    L, N = int(sc.get("chunk_size", 128)), int(sc["max_centroids"])
    return _op_scenario(
        sc, device, op=ovq_attention, reference=lambda **a: ovq_attention_reference(**a).out,
        extra=lambda T, H, D, g, dev: {"beta": torch.full((H,), D**0.5, device=dev)},
        options=dict(chunk_size=L, max_centroids=N),
        flops=lambda T, H, D: _ovq_flops(T, H, D, L, dictionary_sizes(-(-T // L), L, N)))


KINDS["ovq"] = ovq


def train(sc: dict, device: str) -> list[dict]:
    """Training throughput of whole models: ``torch.compile(model)`` AdamW steps on a task's
    batches, for each mixer ``patterns`` entry (the first is the baseline of ``x_vs_baseline``).

    Keys: ``patterns``, ``preset`` (tiny), ``seq_len``, ``batch_size``, ``task`` (icr), ``task_options``,
    ``model_options``,
    ``steps`` (timed steps), ``warmup_steps`` (untimed, include compile), ``compile`` (true).
    """
    import time


    from ..tasks import make_batch
    from ..training import TrainConfig
    from ..training.setup import autocast_dtype, build_model, build_optimizer, build_task
    from ..training.trainer import forward_loss

    dev = torch.device(device)
    steps, warm = int(sc.get("steps", 10)), int(sc.get("warmup_steps", 3))
    rows = []
    for pattern in sc["patterns"]:
        cfg = TrainConfig(task=sc.get("task", "icr"), preset=sc.get("preset", "tiny"), pattern=pattern,
                          seq_len=int(sc["seq_len"]), batch_size=int(sc.get("batch_size", 8)),
                          compile=bool(sc.get("compile", True)), model_options=dict(sc.get("model_options", {})),
                          task_options=dict(sc.get("task_options", {})))
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


KINDS["train"] = train


def _kvm_flops(T: int, H: int, D: int, C: int, Nb: int, sizes: list[int], B: int = 1) -> float:
    """Model FLOPs of KVM attention: the causal front, then per query chunk its state rows,
    the ``Nb - 1`` whole window chunks before it and the causal half of its own chunk."""
    front = min(T, Nb * C)
    total = front * (front + 1) / 2
    for c in range(Nb, -(-T // C)):
        lq = min(C, T - c * C)
        total += lq * (sizes[c] + (Nb - 1) * C) + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total


def kvm(sc: dict, device: str) -> list[dict]:
    """KVM op (SPEC §4.3) through :func:`_op_scenario`.

    Keys: ``heads``, ``head_dim``, ``chunk_size``, ``n_bswa_chunks``, ``sink_len`` and the
    budget options of :func:`ovqflex.kvm_attention` (``budget``, ``growth_factor``, ...;
    ``max_state_chunks = 0`` means uncapped), ``max_backward_len``, ``repeats``.
    """
    import functools

    import torch.nn.functional as F

    from recurrences.kvm import KVMBudget, kvm_state_sizes
    from recurrences.reference import kvm_attention_reference

    from ..ops.kvm import kvm_attention

    C, Nb = int(sc.get("chunk_size", 128)), int(sc.get("n_bswa_chunks", 2))
    budget = {k: sc[k] for k in ("budget", "state_min_len", "growth_factor", "growth_exponent", "round_down",
                                 "saturation_n", "max_state_chunks") if k in sc}
    if budget.get("max_state_chunks") == 0:  # TOML has no null
        budget["max_state_chunks"] = None

    def extra(T, H, D, g, dev):
        return dict(gate=(1 + F.elu(torch.randn(1, H, T, generator=g))).to(dev),
                    ln_s_weight=torch.ones(D, device=dev), ln_s_bias=torch.zeros(D, device=dev),
                    tau_state=torch.ones(H, device=dev), tau_bswa=torch.ones(H, device=dev))

    spec = KVMBudget(**budget)
    sizes = functools.cache(lambda T: kvm_state_sizes(T, C, Nb, spec))  # state rows of each chunk at length T

    def flops(T, H, D):
        return _kvm_flops(T, H, D, C, Nb, sizes(T))

    rows = _op_scenario(sc, device, op=kvm_attention, reference=lambda **a: kvm_attention_reference(**a).out,
                        extra=extra, options=dict(chunk_size=C, n_bswa_chunks=Nb,
                                                  sink_len=int(sc.get("sink_len", 1)), **budget), flops=flops)
    for row in rows:
        row["state_rows_last_chunk"] = (sizes(row["T"]) or [0])[-1]
    return rows


KINDS["kvm"] = kvm


def _vq_flops(T: int, H: int, D: int, C: int, N: int, B: int = 1) -> float:
    """Model FLOPs of VQ attention in linear form: per chunk, the codebook rows (from chunk 2
    on), the whole previous chunk and the causal half of its own chunk."""
    total = 0
    for c in range(-(-T // C)):
        lq = min(C, T - c * C)
        total += lq * (N if c >= 2 else 0) + lq * (C if c >= 1 else 0) + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total


def vq(sc: dict, device: str) -> list[dict]:
    """VQ-attention op (SPEC §4.4) through :func:`_op_scenario`; its "reference loop" is the
    quadratic form ``softmax(q K̂ᵀ + causal) V`` (dense, O(T²) memory: keep T moderate).

    Keys: ``codebook_size``, ``heads``, ``head_dim``, ``chunk_size``, ``max_backward_len``, ``repeats``.
    """
    from recurrences.reference import vq_attention_reference

    from ..ops.vq import vq_attention

    C, N = int(sc.get("chunk_size", 128)), int(sc.get("codebook_size", 512))

    def extra(T, H, D, g, dev):
        return {"codebook": torch.randn(H, N, D, generator=g).to(dev), "beta": torch.full((H,), D**0.5, device=dev)}

    return _op_scenario(sc, device, op=lambda **a: vq_attention(**a)[0],
                        reference=lambda **a: vq_attention_reference(**a).out, extra=extra,
                        options=dict(chunk_size=C), flops=lambda T, H, D: _vq_flops(T, H, D, C, N))


KINDS["vq"] = vq


def viz(sc: dict, device: str) -> list[dict]:
    """The visualizer at scale: build a method's program (random input), then its block view
    (grid, statistics, PNG) — timed and memory-measured separately, for each ``seq_len``.

    Keys: ``method`` (a key of ``ovqflex.viz.VIZ_METHODS``), ``seq_lens``, ``heads`` (1),
    ``head_dim`` (16), ``options`` (layer options), ``views`` (["block"]), ``repeats`` (1).
    """
    import tempfile

    from masks.viz import VizOptions, render

    from ..viz import VizShape, method_program

    method, repeats = sc["method"], int(sc.get("repeats", 1))
    opts = VizOptions(views=tuple(sc.get("views", ["block"])), formats=("png",))
    rows = []
    for T in sc["seq_lens"]:
        shape = VizShape(seq_len=int(T), heads=int(sc.get("heads", 1)), head_dim=int(sc.get("head_dim", 16)))
        build = lambda: method_program(method, shape, dict(sc.get("options", {})))[0]  # noqa: E731
        m_prog = measure(build, device=device, repeats=repeats, warmup=1)
        program = build()
        with tempfile.TemporaryDirectory() as tmp:
            m_view = measure(lambda: render(program, opts, tmp), device=device, repeats=repeats, warmup=0)
        g = program.geom
        for case, m in (("program (op, random input)", m_prog), (f"{'+'.join(opts.views)} view + PNG", m_view)):
            rows.append({"T": int(T), "case": case, "kv_rows": g.kv_len,
                         "blocks": f"{g.n_q_blocks}x{g.n_kv_blocks}", "time_s": m.seconds, "peak_mb": m.peak_mb})
    return rows


KINDS["viz"] = viz


def recurrent(sc: dict, device: str) -> list[dict]:
    """Non-softmax recurrences (linear attention, DeltaNet, VLA; SPEC §4.6): chunked op forward
    and forward+backward, their token-by-token reference loops (up to ``max_reference_len``),
    OVQ (``ovq_backend``, forward) and full causal SDPA, at each ``seq_len`` of ``seq_lens``.

    Keys: ``seq_lens``, ``heads`` (4), ``head_dim`` (64), ``batch`` (1), ``chunk_size`` (64:
    linear, DeltaNet), ``vla_chunk`` (20 = the refresh period), ``max_centroids`` (OVQ, 2048),
    ``ovq_chunk`` (128), ``ovq_backend`` (blocked), ``max_reference_len`` (1024), ``repeats`` (3).
    The runner fits the log-log slope of time and memory vs T of each case.
    """
    import torch.nn.functional as F

    from recurrences.reference import delta_rule_reference, linear_attention_reference, vla_reference

    from ..ops.linear import delta_rule, linear_attention, vla_attention
    from ..ops.ovq import ovq_attention

    dev = torch.device(device)
    B, H, D = int(sc.get("batch", 1)), int(sc.get("heads", 4)), int(sc.get("head_dim", 64))
    C, Cv = int(sc.get("chunk_size", 64)), int(sc.get("vla_chunk", 20))
    N, Lo, ovq_backend = int(sc.get("max_centroids", 2048)), int(sc.get("ovq_chunk", 128)), sc.get("ovq_backend", "blocked")
    repeats, max_ref = int(sc.get("repeats", 3)), int(sc.get("max_reference_len", 1024))
    rows: list[dict] = []
    for T in sc["seq_lens"]:
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


KINDS["recurrent"] = recurrent


def state_layout(sc: dict, device: str) -> list[dict]:
    """OVQ op under each state layout (SPEC §5): state rows, forward and forward+backward time and
    peak memory at each ``seq_len`` of ``seq_lens``; the runner fits the log-log slope of each case.

    Keys: ``seq_lens``, ``max_centroids`` (2048), ``heads`` (2), ``head_dim`` (64), ``chunk_size`` (128),
    ``growth`` (plateau), ``layouts`` (["snapshot", "versioned"]), ``checkpoint_every`` (0: the default),
    ``backend`` (blocked), ``backward`` (true), ``repeats`` (2). ``x_time_vs_snapshot`` is the
    time ratio to the snapshot layout's same case (> 1: slower).
    """
    from ..ops.ovq import ovq_attention, ovq_program

    dev = torch.device(device)
    H, D = int(sc.get("heads", 2)), int(sc.get("head_dim", 64))
    L, N = int(sc.get("chunk_size", 128)), int(sc.get("max_centroids", 2048))
    every = int(sc.get("checkpoint_every", 0)) or None
    backend, repeats = sc.get("backend", "blocked"), int(sc.get("repeats", 2))
    options = dict(chunk_size=L, max_centroids=N, growth=sc.get("growth", "plateau"), checkpoint_every=every)
    rows: list[dict] = []
    for T in sc["seq_lens"]:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, T, D, generator=g).to(dev) for _ in range(3))
        beta = torch.full((H,), D**0.5, device=dev)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta)]
        base: dict[str, float] = {}
        for layout in sc.get("layouts", ["snapshot", "versioned"]):
            with torch.no_grad():
                n_state = ovq_program(q, k, v, beta, state_layout=layout, **options)[0].geom.n_state

            def fwd(layout=layout):
                with torch.no_grad():
                    return ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, **options)

            def fwd_bwd(layout=layout):
                ovq_attention(*leaves, backend=backend, state_layout=layout, **options).sum().backward()
                for x in leaves:
                    x.grad = None

            cases = [("fwd", fwd)] + ([("fwd+bwd", fwd_bwd)] if sc.get("backward", True) else [])
            for what, fn in cases:
                m = measure(fn, device=dev, repeats=repeats)
                base.setdefault(what, m.seconds) if layout == "snapshot" else None
                rows.append({"T": T, "case": f"{layout} {backend} {what}", "state_rows": n_state,
                             "state_rows_per_T": n_state / T, "time_s": m.seconds, "peak_mb": m.peak_mb,
                             "x_time_vs_snapshot": m.seconds / base[what] if what in base else None})
    return rows


KINDS["state_layout"] = state_layout


def _decode_layer(case: dict, hidden: int, heads: int):
    from ..layers import CausalAttention, KVMAttention, OVQAttention, SlidingWindowAttention

    kind = case["kind"]
    opts = {k: v for k, v in case.items() if k not in ("kind", "name")}
    if kind == "ovq":
        return OVQAttention(hidden, heads, backend="flex", **opts)
    if kind == "kvm":
        return KVMAttention(hidden, heads, backend="flex", **opts)
    if kind == "full":
        return CausalAttention(hidden, heads, rope=True, backend="flex", **opts)
    if kind == "swa":
        return SlidingWindowAttention(hidden, heads, backend="flex", **opts)
    raise ValueError(f"decode case kind must be ovq, kvm, full or swa, got {kind!r}")


def decode(sc: dict, device: str) -> list[dict]:
    """Streaming decode at long contexts: each layer ``case`` prefills ``T`` tokens (the
    fused forward, flex, no grad) and then decodes ``decode_tokens`` tokens one per call
    through its cache. Rows: decode tokens/s, seconds per token (``time_s``, whose slope vs
    T is ~0 for a bounded cache and ~1 for a growing KV cache), the cache's own bytes
    (``cache_mb``) and the RSS growth while decoding (``peak_mb``).

    Keys: ``seq_lens``, ``hidden``, ``heads``, ``decode_tokens``, ``repeats``, ``cases``: a list
    of tables with ``name``, ``kind`` (ovq, kvm, full, swa) and the layer's options.
    """
    import time

    dev = torch.device(device)
    hidden, heads, n_dec = int(sc.get("hidden", 256)), int(sc.get("heads", 4)), int(sc.get("decode_tokens", 64))
    rows = []
    for case in sc["cases"]:
        torch.manual_seed(0)
        layer = _decode_layer(case, hidden, heads).to(dev).eval()
        for T in sc["seq_lens"]:
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

                m = measure(run, device=dev, repeats=int(sc.get("repeats", 2)), warmup=1)
                end = run()
            rows.append({"case": case["name"], "T": T, "prefill_s": prefill, "tokens_per_s": n_dec / m.seconds,
                         "time_s": m.seconds / n_dec, "cache_mb": end.nbytes() / 2**20,
                         "cache_mb_prefill": cache.nbytes() / 2**20, "peak_mb": m.peak_mb})
    by_t = {}
    for r in rows:
        by_t.setdefault(r["T"], []).append(r)
    base = sc["cases"][-1]["name"]  # the last case is the baseline (full attention's KV cache)
    for rs in by_t.values():
        ref = next((r for r in rs if r["case"] == base), None)
        for r in rs:
            if ref is not None:
                r["x_vs_" + base] = r["tokens_per_s"] / ref["tokens_per_s"]
    return rows


KINDS["decode"] = decode


def quantized(sc: dict, device: str) -> list[dict]:
    """A model's decode throughput and output agreement, fp32 vs torchao int8 weight-only.

    Keys: ``preset``, ``pattern``, ``vocab_size``, ``model_options``, ``prompt_len``,
    ``decode_tokens``, ``repeats``. Rows: tokens/s, ``x_vs_fp32`` and ``rel_err_logits`` of the
    prompt's logits against the fp32 model (the stated tolerance is 2e-2).
    """
    import copy

    from ..models import HybridLM
    from ..models.config import preset
    from ..quantize import quantize_model

    dev = torch.device(device)
    cfg = preset(sc.get("preset", "tiny"), pattern=sc.get("pattern", "swa,ovq"),
                 vocab_size=int(sc.get("vocab_size", 256)), backend="flex", **dict(sc.get("model_options", {})))
    torch.manual_seed(0)
    fp32 = HybridLM(cfg).to(dev).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, int(sc.get("prompt_len", 1024))), device=dev)
    n_dec = int(sc.get("decode_tokens", 64))
    rows, ref_logits = [], None
    for mode in ("none", "int8"):
        model = quantize_model(copy.deepcopy(fp32), mode)
        with torch.no_grad():
            logits = model(prompt)
            m = measure(lambda: model.generate(prompt, n_dec, temperature=0), device=dev,
                        repeats=int(sc.get("repeats", 2)), warmup=1)
        ref_logits = logits if ref_logits is None else ref_logits
        err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        rows.append({"case": "fp32" if mode == "none" else mode, "pattern": cfg.pattern,
                     "prompt": prompt.shape[1], "generate_s": m.seconds, "tokens_per_s": n_dec / m.seconds,
                     "rel_err_logits": err})
    for r in rows:
        r["x_vs_fp32"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


KINDS["quantized"] = quantized
