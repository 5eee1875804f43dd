"""Decode scenario: streaming decode of single layers after a prefill, functional or static caches."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recurrences.checks import ConfigError, check_choice, check_keys

from ...compile_watch import compile_counts
from ...devices import sync
from ...methods import METHODS, Method, method_names
from ...models.hybrid import DECODES, static_step
from ..measure import measure, progress, relative_error
from .base import Scenario, register, runs_on


def _decode_method(case: dict, where: str) -> tuple[Method, dict, str]:
    """The method of a decode ``case`` table (``name``, ``kind``: a method that decodes, ``decode``:
    one of ``DECODES``, default ``"functional"``, and the options of its layer, checked by name);
    returns (method, layer options, decode); the options set the flex backend where the layer has one."""
    if not isinstance(case, dict) or not isinstance(case.get("name"), str):
        raise ValueError(f"{where}: must be a table with a string name, got {case!r}")
    decoding = method_names(_decodes)
    if case.get("kind") not in decoding:
        raise ValueError(f"{where}: kind must be one of {decoding}, got {case.get('kind')!r}")
    method = METHODS[case["kind"]]
    check_keys(f"{where} (a {method.layer.__name__})", case,
               method.option_names() - {"backend"} | {"name", "kind", "decode"})
    decode = check_choice(f"{where}: decode", case.get("decode", "functional"), DECODES)
    if decode != "functional" and method.layer.static_cache_type is None:
        raise ValueError(f"{where}: decode={decode!r} needs a static cache, which {method.layer.__name__} has not")
    options = {k: v for k, v in case.items() if k not in ("kind", "name", "decode")}
    if "backend" in method.option_names():
        options["backend"] = "flex"
    return method, options, decode


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
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # sequences decoded together

    def __post_init__(self):
        for i, case in enumerate(self.cases):
            method, options, _ = _decode_method(case, f"case {i}")
            try:  # the layer the case times: its option values, by name
                method.build(self.hidden, self.heads, **options)
            except (ValueError, ConfigError) as e:
                raise type(e)(f"case {i} ({case['name']!r}): {e}") from None


@register("decode", DecodeScenario)
def decode(sc: DecodeScenario, device: str) -> list[dict]:
    """Streaming decode at long contexts: each layer ``case`` prefills ``T`` tokens (the
    fused forward, flex, no grad) and then decodes ``decode_tokens`` tokens one per call
    through its cache — the functional one, or (case ``decode = "static"`` / ``"compiled"`` /
    ``"graph"``) the in-place static cache made after the prefill, eager, compiled, or compiled and
    replayed from one CUDA graph (compiled and captured in the warm-up run, not timed; each timed run
    continues the same cache; ``"graph"`` needs CUDA and is left out elsewhere). Every case runs at
    every ``batch`` of ``batch_sizes`` (that many sequences decoded together, one token each per
    call) and every ``T``, on the same tokens (drawn from seed 0 per ``batch`` and ``T``; each layer is
    initialised from seed 0). Rows: ``batch``, decode tokens/s (``tokens_per_s``: the tokens of all ``batch``
    rows, ``batch * decode_tokens / seconds``), seconds per decode step (``time_s``: per token at batch
    1, per ``batch`` tokens otherwise; its slope vs T is ~0 for a bounded cache and ~1 for a
    growing KV cache), the cache's own bytes (``cache_mb``, all rows of the batch) and the RSS
    growth while decoding (``peak_mb``), the graphs dynamo compiled for the decode (``compiled_graphs``:
    its untimed warm-up included; 0 for an eager decode) and ``rel_err_vs_forward``: the last run's
    decoded outputs against the layer's full forward of the tokens its cache took in (untimed), relative
    (norm of the difference over the forward's norm). The last case is the baseline of ``x_vs_<name>``,
    at the same ``batch`` and ``T``.
    """
    import time

    dev = torch.device(device)
    hidden, heads, n_dec = sc.hidden, sc.heads, sc.decode_tokens
    rows = []
    for i, case in enumerate(sc.cases):
        method, options, mode = _decode_method(case, f"scenario {sc.name!r}, case {i}")
        if not runs_on(mode, dev, f"scenario {sc.name!r}, case {case['name']!r}"):
            continue
        torch.manual_seed(0)
        layer = method.build(hidden, heads, **options).to(dev).eval()
        for batch in sc.batch_sizes:
            for T in sc.seq_lens:
                g = torch.Generator().manual_seed(0)
                x = torch.randn(batch, T + n_dec, hidden, generator=g).to(dev)
                with torch.no_grad():
                    t0 = time.perf_counter()
                    _, cache = layer(x[:, :T], use_cache=True)
                    sync(dev)
                    prefill = time.perf_counter() - t0

                    graphs = compile_counts().graphs
                    if mode == "functional":
                        run = _functional_run(layer, cache, x, T, n_dec)
                    else:
                        run = _static_run(layer, cache, x, T, n_dec, sc.repeats, mode)
                    m = measure(run, device=dev, repeats=sc.repeats, warmup=1)
                    graphs = compile_counts().graphs - graphs
                    end, taken, ys = run(keep=True)
                    cache_mb, prefill_mb = end.nbytes() / 2**20, cache.nbytes() / 2**20
                    del run, end, cache  # the check's memory: a static run holds its cache and graph
                    err = _rel_err_vs_forward(layer, x, T, taken, torch.cat(ys, dim=1))
                rows.append({"case": case["name"], "decode": mode, "batch": batch, "T": T, "prefill_s": prefill,
                             "tokens_per_s": batch * n_dec / m.seconds,
                             "time_s": m.seconds / n_dec, "cache_mb": cache_mb,
                             "cache_mb_prefill": prefill_mb, "peak_mb": m.peak_mb,
                             "compiled_graphs": graphs, "rel_err_vs_forward": err})
                progress(f"decode {case['name']} batch {batch} T={T} ({rows[-1]['tokens_per_s']:,.0f} tokens/s)",
                         m.seconds / n_dec)
                del x, ys  # the next prefill's memory
    by_t = {}
    for r in rows:
        by_t.setdefault((r["batch"], r["T"]), []).append(r)
    base = sc.cases[-1]["name"]  # the last case is the baseline (full attention's KV cache)
    for rs in by_t.values():
        ref = next((r for r in rs if r["case"] == base), None)
        for r in rs:
            if ref is not None:
                r["x_vs_" + base] = r["tokens_per_s"] / ref["tokens_per_s"]
    return rows


def _rel_err_vs_forward(layer, x, T: int, taken: list[int], out) -> float:
    """How far the decoded outputs ``out [B, n, hidden]`` (the last ``n`` tokens a cache took in) are from
    the layer's full forward of what that cache took in: ``x[:, :T]`` (the prefill), then the tokens
    ``x[:, taken]``; ``|out - forward| / |forward|`` over those last ``n`` positions."""
    if taken == list(range(T, T + len(taken))):
        seq = x[:, :T + len(taken)]
    else:  # a static run that re-took tokens
        seq = torch.cat([x[:, :T], x[:, taken]], dim=1)
    return relative_error(out, layer(seq)[:, -out.shape[1]:])


def _functional_run(layer, cache, x, T: int, n_dec: int):
    """A run of ``n_dec`` functional decode steps, each run from the prefill's ``cache`` (never mutated):
    ``run(keep=False)`` -> (the cache after them, the positions of ``x`` they took in, and with ``keep``
    their outputs)."""
    def run(keep: bool = False):
        c, ys = cache, []
        for i in range(n_dec):
            y, c = layer(x[:, T + i:T + i + 1], cache=c)
            if keep:
                ys.append(y)
        return c, list(range(T, T + n_dec)), ys

    return run


def _static_run(layer, cache, x, T: int, n_dec: int, repeats: int, mode: str):
    """A run of ``n_dec`` static decode steps continuing one static cache made from ``cache``
    (room for ``measure``'s warm-up, ``repeats`` and memory runs and the final one): eager
    (``mode="static"``), compiled, or the compiled step replayed from one CUDA graph (``"graph"``);
    ``run(keep=False)`` -> (the static cache, the positions of ``x`` it took in since the prefill, and with
    ``keep`` the run's outputs, copied: a graph's output is one buffer). Before the first run,
    ``chunk_size`` steps (the layer's, if it has one) run untimed: they cross one chunk boundary, so the
    compile of the boundary's routing step (once per cache bound) is not timed either when ``n_dec`` is
    shorter than a chunk. The steps reuse the decode tokens ``x[:, T:T + n_dec]`` in turn."""
    warm = getattr(layer, "chunk_size", 0)
    static = layer.static_cache(cache, T + warm + n_dec * (repeats + 3))
    compiled = mode != "static"
    step = static_step(lambda xt, c: layer(xt, cache=c)[0], mode, x.device)
    taken: list[int] = []

    def steps(n: int, keep: bool = False):
        ys = []
        for i in range(n):
            t = T + i % n_dec
            y = step(x[:, t:t + 1], static)
            if keep:
                ys.append(y.clone())
            taken.append(t)
            layer.static_boundary(static, T + len(taken), compile=compiled)
        return static, taken, ys

    steps(warm)
    return lambda keep=False: steps(n_dec, keep)
