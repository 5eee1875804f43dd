"""Model scenarios: training throughput of mixer patterns, streaming decode of layers, a model's
generation (first token and new tokens/s), int8 generation."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recurrences.checks import check_choice, check_int, check_keys

from ...methods import METHODS, Method, method_names
from ...models.hybrid import DECODES
from ..measure import measure, sync
from .base import Scenario, register


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

    from ...tasks import make_batch
    from ...training import TrainConfig
    from ...training.setup import autocast_dtype, build_model, build_optimizer, build_task
    from ...training.trainer import forward_loss

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


def _check_sizes(where: str, sizes: list[int]) -> None:
    """``sizes`` (batch sizes, lengths): a non-empty list of positive ints."""
    if not sizes:
        raise ValueError(f"{where} must list at least one size, got {sizes!r}")
    for i, n in enumerate(sizes):
        check_int(f"{where}[{i}]", n)


def _decode_method(case: dict, where: str) -> tuple[Method, dict, str]:
    """The method of a decode ``case`` table (``name``, ``kind``: a method that decodes, ``decode``:
    one of ``DECODES``, default ``"functional"``, and the options of its layer, checked by name);
    returns (method, layer options, decode)."""
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
    return method, {k: v for k, v in case.items() if k not in ("kind", "name", "decode")}, decode


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
        _check_sizes(f"scenario {self.name!r}: batch_sizes", self.batch_sizes)
        if not self.cases:
            raise ValueError(f"scenario {self.name!r}: cases must list at least one [[scenario.cases]] table")
        for i, case in enumerate(self.cases):
            _decode_method(case, f"scenario {self.name!r}, case {i}")


@register("decode", DecodeScenario)
def decode(sc: DecodeScenario, device: str) -> list[dict]:
    """Streaming decode at long contexts: each layer ``case`` prefills ``T`` tokens (the
    fused forward, flex, no grad) and then decodes ``decode_tokens`` tokens one per call
    through its cache — the functional one, or (case ``decode = "static"`` / ``"compiled"``) the
    in-place static cache made after the prefill, eager or compiled (compiled in the warm-up run,
    not timed; each timed run continues the same cache). Every case runs at every ``batch`` of
    ``batch_sizes`` (that many sequences decoded together, one token each per call) and every
    ``T``. Rows: ``batch``, decode tokens/s (``tokens_per_s``: the tokens of all ``batch`` rows,
    ``batch * decode_tokens / seconds``), seconds per decode step (``time_s``: per token at batch
    1, per ``batch`` tokens otherwise; its slope vs T is ~0 for a bounded cache and ~1 for a
    growing KV cache), the cache's own bytes (``cache_mb``, all rows of the batch) and the RSS
    growth while decoding (``peak_mb``). The last case is the baseline of ``x_vs_<name>``, at the
    same ``batch`` and ``T``.
    """
    import time

    dev = torch.device(device)
    hidden, heads, n_dec = sc.hidden, sc.heads, sc.decode_tokens
    rows = []
    for i, case in enumerate(sc.cases):
        torch.manual_seed(0)
        method, options, mode = _decode_method(case, f"scenario {sc.name!r}, case {i}")
        if "backend" in method.option_names():
            options["backend"] = "flex"
        layer = method.build(hidden, heads, **options).to(dev).eval()
        for batch in sc.batch_sizes:
            for T in sc.seq_lens:
                x = torch.randn(batch, T + n_dec, hidden, device=dev)
                with torch.no_grad():
                    t0 = time.perf_counter()
                    _, cache = layer(x[:, :T], use_cache=True)
                    sync(dev)
                    prefill = time.perf_counter() - t0

                    if mode == "functional":
                        def run():
                            c = cache
                            for i in range(n_dec):
                                _, c = layer(x[:, T + i:T + i + 1], cache=c)
                            return c
                    else:
                        run = _static_run(layer, cache, x, T, n_dec, sc.repeats, compiled=mode == "compiled")

                    m = measure(run, device=dev, repeats=sc.repeats, warmup=1)
                    end = run()
                rows.append({"case": case["name"], "decode": mode, "batch": batch, "T": T, "prefill_s": prefill,
                             "tokens_per_s": batch * n_dec / m.seconds,
                             "time_s": m.seconds / n_dec, "cache_mb": end.nbytes() / 2**20,
                             "cache_mb_prefill": cache.nbytes() / 2**20, "peak_mb": m.peak_mb})
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


def _static_run(layer, cache, x, T: int, n_dec: int, repeats: int, *, compiled: bool):
    """A run of ``n_dec`` static decode steps continuing one static cache made from ``cache``
    (room for ``measure``'s warm-up, ``repeats`` and memory runs and the final one), eager or
    compiled; returns the static cache."""
    static = layer.static_cache(cache, T + n_dec * (repeats + 3))
    step = torch.compile(layer, fullgraph=True, dynamic=False) if compiled else layer
    position = [T]

    def run():
        for i in range(n_dec):
            step(x[:, T + i:T + i + 1], cache=static)
            position[0] += 1
            layer.static_boundary(static, position[0], compile=compiled)
        return static

    return run


@dataclass(kw_only=True)
class ModelScenario(Scenario):
    """Keys of the scenarios that time a whole ``HybridLM`` of a preset (random init)."""

    preset: str = "tiny"
    pattern: str = "swa,ovq"
    vocab_size: int = 256
    model_options: dict = field(default_factory=dict)
    repeats: int = 2

    def config(self):
        """The model's ``HybridConfig``: flex attention unless ``model_options`` names another ``backend``."""
        from ...models.config import preset

        return preset(self.preset, pattern=self.pattern, vocab_size=self.vocab_size,
                      **{"backend": "flex", **self.model_options})


@dataclass(kw_only=True)
class GenerateScenario(ModelScenario):
    prompt_lens: list[int] = field(default_factory=lambda: [1024])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    new_tokens: int = 64
    decodes: list[str] = field(default_factory=lambda: ["functional"])  # the first is the baseline of x_vs_

    def __post_init__(self):
        where = f"scenario {self.name!r}"
        _check_sizes(f"{where}: prompt_lens", self.prompt_lens)
        _check_sizes(f"{where}: batch_sizes", self.batch_sizes)
        check_int(f"{where}: new_tokens", self.new_tokens, minimum=2)
        check_int(f"{where}: repeats", self.repeats)
        if not self.decodes or len(set(self.decodes)) != len(self.decodes):
            raise ValueError(f"{where}: decodes must list distinct decodes of {list(DECODES)}, got {self.decodes!r}")
        for d in self.decodes:
            check_choice(f"{where}: decodes", d, DECODES)
        try:  # the preset, pattern and model options, by name
            mixers = self.config().mixers
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from e
        for name in dict.fromkeys(mixers):
            layer = METHODS[name].layer
            if not METHODS[name].decodes:
                raise ValueError(f"{where}: mixer {name!r} ({layer.__name__}) has no decode cache")
            if set(self.decodes) - {"functional"} and layer.static_cache_type is None:
                raise ValueError(f"{where}: decodes {self.decodes!r} need a static cache, which mixer {name!r} "
                                 f"({layer.__name__}) has not")


@register("generate", GenerateScenario)
def generate(sc: GenerateScenario, device: str) -> list[dict]:
    """A model's generation speed: the ``HybridLM`` of ``preset`` / ``pattern`` (random init, seed
    0, eval, flex unless ``model_options`` names another ``backend``) continues random prompts
    greedily (``generate(..., temperature=0, decode=...)``) for every ``decode`` of ``decodes``,
    ``batch`` of ``batch_sizes`` and ``prompt`` length of ``prompt_lens``; each measurement follows
    an untimed warm-up call of the same shapes (so compilation is not timed) and is the median of
    ``repeats`` runs.

    Rows: ``prefill_s``, the time of the first token: one ``model(prompt, use_cache=True)``
    forward over the prompt, timed on its own, once per batch and prompt length (the decode path
    does not change it; ``prefill_peak_mb``: its memory growth); ``decode_s``, the rest of a ``generate`` call,
    measured directly inside it: from the end of its prefill forward (a forward hook on the model
    reads the clock, after a device sync, when the first forward of the call returns) to its
    return — the static caches' allocation (static / compiled), ``new_tokens - 1`` decode steps
    and the sampling; ``new_tokens_per_s = batch * (new_tokens - 1) / decode_s`` (tokens of all
    rows of the batch; the first new token comes with the prefill's logits); ``x_vs_<first
    decode>`` at the same batch and prompt; ``same_tokens``: whether the generated tokens equal
    the functional decode's (None without ``"functional"`` in ``decodes``; equal up to float
    rounding, so reported, not asserted).
    """
    from ...models import HybridLM

    dev = torch.device(device)
    cfg = sc.config()
    torch.manual_seed(0)
    model = HybridLM(cfg).to(dev).eval()
    rows, outputs, prefills = [], {}, {}
    for mode in sc.decodes:
        for batch in sc.batch_sizes:
            for n_prompt in sc.prompt_lens:
                g = torch.Generator().manual_seed(batch * 1_000_003 + n_prompt)  # one prompt for every decode
                prompt = torch.randint(0, cfg.vocab_size, (batch, n_prompt), generator=g).to(dev)
                if (batch, n_prompt) not in prefills:
                    with torch.no_grad():
                        prefills[batch, n_prompt] = measure(lambda: model(prompt, use_cache=True), device=dev,
                                                            repeats=sc.repeats, warmup=1)
                prefill = prefills[batch, n_prompt]
                out, decode_s = _timed_generate(model, prompt, sc.new_tokens, mode, dev, sc.repeats)
                outputs[mode, batch, n_prompt] = out.cpu()
                rows.append({"decode": mode, "batch": batch, "prompt": n_prompt, "prefill_s": prefill.seconds,
                             "prefill_peak_mb": prefill.peak_mb, "decode_s": decode_s,
                             "new_tokens_per_s": batch * (sc.new_tokens - 1) / decode_s})
    first = sc.decodes[0]
    for r in rows:
        key = (r["batch"], r["prompt"])
        r["x_vs_" + first] = r["new_tokens_per_s"] / next(
            b["new_tokens_per_s"] for b in rows if b["decode"] == first and (b["batch"], b["prompt"]) == key)
        ref = outputs.get(("functional", *key))
        r["same_tokens"] = None if ref is None else torch.equal(outputs[(r["decode"], *key)], ref)
    return rows


def _timed_generate(model, prompt, new_tokens: int, mode: str, dev: torch.device, repeats: int):
    """``model.generate(prompt, new_tokens, temperature=0, decode=mode)`` after an untimed warm-up
    call -> (its tokens, the median over ``repeats`` calls of the seconds from the end of the
    call's prefill forward to its return)."""
    import statistics
    import time

    marks = []

    def after_prefill(module, args, output):
        if not marks:  # the call's first forward is its prefill
            sync(dev)
            marks.append(time.perf_counter())

    handle = model.register_forward_hook(after_prefill)
    times = []
    try:
        for i in range(1 + repeats):
            marks.clear()
            out = model.generate(prompt, new_tokens, temperature=0, decode=mode)
            sync(dev)
            if i:
                times.append(time.perf_counter() - marks[0])
    finally:
        handle.remove()
    return out, statistics.median(times)


@dataclass(kw_only=True)
class QuantizedScenario(ModelScenario):
    prompt_len: int = 1024
    decode_tokens: int = 64


@register("quantized", QuantizedScenario)
def quantized(sc: QuantizedScenario, device: str) -> list[dict]:
    """A model's decode throughput and output agreement, fp32 vs torchao int8 weight-only.
    Rows: tokens/s, ``x_vs_fp32`` and ``rel_err_logits`` of the prompt's logits against the
    fp32 model (the stated tolerance is 2e-2).
    """
    import copy

    from ...models import HybridLM
    from ...quantize import quantize_model

    dev = torch.device(device)
    cfg = sc.config()
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
