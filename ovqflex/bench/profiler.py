"""``ovqflex profile``: a layer or a model step under ``torch.profiler``, stage by stage.

Runs ``warmup`` untimed steps (compilation happens there), then ``steps`` profiled steps
per mode — ``fwd`` (no grad: inference, what ``auto`` sends to flex) and ``fwd+bwd``
(forward with grad, then backward) — exports the Chrome/Perfetto trace and reduces
that same trace to a per-stage table: the stages labelled by
:func:`ovqflex.profiling.stage`, plus ``backward``, ``other`` (step minus stages)
and the whole ``step``. Memory columns come from the trace's allocator events:
``peak MB`` is the largest allocation level inside a stage above the level when it
began (max over calls); ``alloc MB`` the bytes it allocated per step.
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..devices import resolve_device, sync
from ..profiling import MODES, PREFIX, STAGES, ProfileConfig

STEP = PREFIX + "step"
BACKWARD = PREFIX + "backward"


def _build(cfg: ProfileConfig):
    """-> (module, make_input(), loss(output, input)) on the config's device."""
    dev = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if cfg.target == "model":
        from ..models import HybridLM, preset

        over = dict(cfg.options)
        if cfg.pattern:
            over["pattern"] = cfg.pattern
        model = HybridLM(preset(cfg.preset, **over)).to(dev)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(cfg.seed)
        tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq_len + 1), generator=g).to(dev)
        x, y = tokens[:, :-1], tokens[:, 1:]

        def loss(logits, _):
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

        return model, x, loss
    from ..methods import METHODS, method_names

    if cfg.target not in method_names():
        raise ValueError(f"target must be 'model' or one of {method_names()}, got {cfg.target!r}")
    layer = METHODS[cfg.target].example(cfg.heads, cfg.head_dim, cfg.options, f"target {cfg.target!r}").to(dev)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, cfg.seq_len, cfg.heads * cfg.head_dim, generator=g).to(dev)
    return layer, x, lambda y, _: y.float().square().mean()


def _step(module, x, loss, mode: str) -> None:
    with record_function(f"{STEP}[{mode}]"):
        if mode == "fwd":
            with torch.no_grad():
                module(x)
        else:
            out = loss(module(x), x)
            with record_function(BACKWARD):
                out.backward()
            module.zero_grad(set_to_none=True)
        sync(x.device)


def profile_target(cfg: ProfileConfig, trace: str | Path) -> list[dict]:
    """Profile, write the trace to ``trace``, return the per-stage rows (also see :func:`stage_table`)."""
    module, x, loss = _build(cfg)
    for mode in cfg.modes:
        for _ in range(cfg.warmup):
            _step(module, x, loss, mode)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.device.type == "cuda" else [])
    with profile(activities=acts, profile_memory=True) as prof:
        for mode in cfg.modes:
            for _ in range(cfg.steps):
                _step(module, x, loss, mode)
    trace = Path(trace)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return stage_table(json.loads(trace.read_text()), device_type=1 if x.device.type == "cuda" else 0)


def stage_table(trace: dict, device_type: int = 0) -> list[dict]:
    """Reduce a Chrome trace to rows ``{mode, stage, calls/step, ms/step, % of step, alloc MB, peak MB}``."""
    events = trace["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type)
    mem_ts = [m[0] for m in mem]
    spans = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(PREFIX)]
    steps = [e for e in spans if e["name"].startswith(STEP + "[")]
    labels = [PREFIX + s for s in STAGES] + [BACKWARD]

    def memory(t0, t1):
        i, j = bisect.bisect_left(mem_ts, t0), bisect.bisect_right(mem_ts, t1)
        base = mem[i - 1][1] if i else 0
        inside = mem[i:j]
        peak = max((m[1] for m in inside), default=base) - base
        return max(peak, 0), sum(m[2] for m in inside if m[2] > 0)

    rows = []
    for mode in MODES:
        mine = [s for s in steps if s["name"] == f"{STEP}[{mode}]"]
        if not mine:
            continue
        n = len(mine)
        step_us = sum(s["dur"] for s in mine)
        step_mem = [memory(s["ts"], s["ts"] + s["dur"]) for s in mine]
        staged = 0.0
        for label in labels:
            hits = [e for e in spans if e["name"] == label
                    and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in mine)]
            if not hits:
                continue
            us = sum(e["dur"] for e in hits)
            staged += us
            mems = [memory(e["ts"], e["ts"] + e["dur"]) for e in hits]
            rows.append({"mode": mode, "stage": label[len(PREFIX):], "calls/step": len(hits) / n,
                         "ms/step": us / n / 1e3, "% of step": 100 * us / step_us,
                         "alloc MB": sum(m[1] for m in mems) / n / 2**20, "peak MB": max(m[0] for m in mems) / 2**20})
        rows.append({"mode": mode, "stage": "other", "calls/step": None, "ms/step": (step_us - staged) / n / 1e3,
                     "% of step": 100 * (step_us - staged) / step_us, "alloc MB": None, "peak MB": None})
        rows.append({"mode": mode, "stage": "step", "calls/step": 1.0, "ms/step": step_us / n / 1e3,
                     "% of step": 100.0, "alloc MB": sum(m[1] for m in step_mem) / n / 2**20,
                     "peak MB": max(m[0] for m in step_mem) / 2**20})
    return rows
