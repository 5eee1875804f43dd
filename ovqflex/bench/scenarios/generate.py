"""Generation scenarios: a whole model's generation (first token and new tokens/s per decode path),
and fp32 vs int8 generation."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recurrences.checks import check_choice, check_int

from ...devices import sync
from ...methods import METHODS
from ...models.hybrid import DECODES
from ..measure import measure, progress, relative_error
from .base import Scenario, register, runs_on


@dataclass(kw_only=True)
class ModelScenario(Scenario):
    """Keys of the scenarios that time a whole ``HybridLM`` of a preset (random init)."""

    preset: str = "tiny"
    pattern: str = "swa,ovq"
    vocab_size: int = 256
    model_options: dict = field(default_factory=dict)
    repeats: int = 2

    def __post_init__(self):
        self.config()  # the preset, pattern and model options, by name

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
        check_int("new_tokens", self.new_tokens, minimum=2)
        if len(set(self.decodes)) != len(self.decodes):
            raise ValueError(f"decodes must list distinct decodes of {list(DECODES)}, got {self.decodes!r}")
        for d in self.decodes:
            check_choice("decodes", d, DECODES)
        for name in dict.fromkeys(self.config().mixers):
            layer = METHODS[name].layer
            if not METHODS[name].decodes:
                raise ValueError(f"mixer {name!r} ({layer.__name__}) has no decode cache")
            if set(self.decodes) - {"functional"} and layer.static_cache_type is None:
                raise ValueError(f"decodes {self.decodes!r} need a static cache, which mixer {name!r} "
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
    return — the static caches' allocation (static / compiled / graph), for ``"graph"`` the
    capture of the step (one step run for real, then recorded), ``new_tokens - 1`` decode steps
    and the sampling; ``new_tokens_per_s = batch * (new_tokens - 1) / decode_s`` (tokens of all
    rows of the batch; the first new token comes with the prefill's logits); ``x_vs_<first
    decode>`` at the same batch and prompt (``"graph"`` needs CUDA and is left out elsewhere);
    ``same_tokens``: whether the generated tokens equal the functional decode's (None without
    ``"functional"`` in ``decodes``; equal up to float rounding, so reported, not asserted).
    """
    from ...models import HybridLM

    dev = torch.device(device)
    cfg = sc.config()
    torch.manual_seed(0)
    model = HybridLM(cfg).to(dev).eval()
    rows, outputs, prefills = [], {}, {}
    modes = [m for m in sc.decodes if runs_on(m, dev, f"scenario {sc.name!r}")]
    if not modes:
        return []
    for mode in modes:
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
                progress(f"generate {mode} batch {batch} prompt {n_prompt} "
                         f"({rows[-1]['new_tokens_per_s']:,.0f} new tokens/s)", decode_s)
    first = modes[0]
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
        err = relative_error(logits, ref_logits)
        rows.append({"case": "fp32" if mode == "none" else mode, "pattern": cfg.pattern,
                     "prompt": prompt.shape[1], "generate_s": m.seconds, "tokens_per_s": n_dec / m.seconds,
                     "rel_err_logits": err})
    for r in rows:
        r["x_vs_fp32"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows
