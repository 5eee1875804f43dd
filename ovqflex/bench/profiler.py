"""``ovqflex profile``: a layer or a model step under ``torch.profiler``, stage by stage.

Runs ``warmup`` untimed steps (compilation happens there), then ``steps`` profiled steps
per mode — ``fwd`` (no grad: inference, what ``auto`` sends to flex) and ``fwd+bwd``
(forward with grad, then backward) — exports the Chrome/Perfetto trace and reduces
that same trace to two tables:

- per stage (:func:`stage_table`): the stages labelled by :func:`ovqflex.profiling.stage`, plus
  ``backward``, ``other`` (step minus stages) and the whole ``step``. ``ms/step`` is host time:
  on CUDA the time to launch, which a stage that does not wait for its kernels ends before they
  run. So on CUDA a ``gpu ms/step`` column adds the device time of the kernels, copies and
  memsets each stage launched (busy time, summed), and ``gpu span ms/step`` the device time from
  the first of them to start to the last to end, in each call of the stage (the ``step`` row: in
  each step): busy time plus the gaps between them. A stage whose span is much longer than its
  busy time is bound by launches (in a CUDA graph, the device's latency from one kernel to the
  next; eager, the host launching), not by its kernels' work. Memory columns come from the trace's
  allocator events: ``peak MB`` is the largest allocation level inside a stage above the level when it
  began (max over calls); ``alloc MB`` the bytes it allocated per step.
- per kernel (:func:`kernel_table`): the ``top`` kernels of each stage by device time on CUDA,
  the ``top`` operators by self time (their time minus that of the operators they called) on a
  CPU. A work item belongs to the innermost labelled span open when it was launched (CUDA:
  the runtime or driver call whose correlation id the kernel carries; every kernel of a CUDA
  graph replay carries its ``cudaGraphLaunch``'s), so the kernels of a routing run captured in
  a CUDA graph show under ``routing`` one by one.
"""
from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..devices import resolve_device, sync
from ..profiling import MODES, PREFIX, STAGES, ProfileConfig

STEP = PREFIX + "step"
BACKWARD = PREFIX + "backward"
#: trace categories of device work, and of the host calls that launch it (matched by correlation id)
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
#: a kernel name is cut to this many characters in the kernel table (CUDA template names run to hundreds)
NAME_WIDTH = 72


@dataclass
class ProfileTables:
    """What :func:`profile_target` returns: the rows of :func:`stage_table` and of :func:`kernel_table`."""

    stages: list[dict]
    kernels: list[dict]


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


def profile_target(cfg: ProfileConfig, trace: str | Path) -> ProfileTables:
    """Profile, write the trace to ``trace``, return its per-stage and per-kernel rows (``cfg.kernels``
    per stage; :func:`stage_table`, :func:`kernel_table`)."""
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
    data = json.loads(trace.read_text())
    device_type = 1 if x.device.type == "cuda" else 0
    return ProfileTables(stage_table(data, device_type), kernel_table(data, cfg.kernels) if cfg.kernels else [])


def _label_spans(events: list[dict]) -> list[dict]:
    """The host spans of ``ovqflex.*`` labels (on CUDA the trace repeats each on the device's
    timeline as a ``gpu_user_annotation``, which is left out)."""
    return [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(PREFIX)
            and e.get("cat") != "gpu_user_annotation"]


def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """``(op, self time in us)`` for host operator spans: its duration minus its direct children's
    (the spans of its thread nested inside it)."""
    out = []
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for mine in by_thread.values():
        mine.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [op, end, children's time]
        for e in mine:
            while stack and e["ts"] >= stack[-1][1]:
                op, _, children = stack.pop()
                out.append((op, op["dur"] - children))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, e["ts"] + e["dur"], 0.0])
        out.extend((op, op["dur"] - children) for op, _, children in stack)
    return out


@dataclass(frozen=True)
class _Item:
    """One work item of a trace, attributed to a step and a stage call (:func:`_attribute`): a kernel,
    copy or memset (``start``: its device start time), or a host operator (``start``: its own host time);
    ``us``: its device time, or a host operator's self time; ``step``, ``call``: the host start times of
    the step span and of the innermost labelled span (the step's, outside every stage) it belongs to."""

    name: str
    us: float
    start: float
    step: float
    call: float


def _work(events: list[dict]) -> tuple[list[tuple[float, str, float, float]], bool]:
    """The trace's work items ``(host time it was launched or ran, name, device or self time in us, start
    time)``, and whether they are device work. Device work (kernels, copies, memsets) when the trace has
    any, each at the time of the host call that launched it; else the host operators with their self times."""
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK]
    if device:
        return [(launched[e["args"]["correlation"]], e["name"], e["dur"], e["ts"]) for e in device
                if e.get("args", {}).get("correlation") in launched], True
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    return [(op["ts"], op["name"], self_us, op["ts"]) for op, self_us in _self_times(ops)], False


def _attribute(events: list[dict]) -> tuple[dict, bool]:
    """Work items by ``(mode, label)``: each goes to the innermost labelled span open at its host time
    (label ``None``: a step's work outside every stage), within the step span of its mode. Returns
    ``{(mode, label): [_Item, ...]}`` and whether the items are device work."""
    spans = _label_spans(events)
    steps = [e for e in spans if e["name"].startswith(STEP + "[")]
    inner = sorted((e for e in spans if not e["name"].startswith(STEP + "[")), key=lambda e: e["dur"])
    work, on_device = _work(events)
    out = defaultdict(list)
    for ts, name, us, start in work:
        step = next((s for s in steps if s["ts"] <= ts <= s["ts"] + s["dur"]), None)
        if step is None:
            continue
        span = next((e for e in inner if e["ts"] <= ts <= e["ts"] + e["dur"]), step)
        label = None if span is step else span["name"]
        out[(step["name"][len(STEP) + 1:-1], label)].append(_Item(name, us, start, step["ts"], span["ts"]))
    return out, on_device


def _span_us(items: list[_Item], per: str) -> float:
    """Device time from the first item's start to the last one's end within each step (``per="step"``) or
    each call of a stage (``per="call"``), summed."""
    first, last = {}, {}
    for it in items:
        key = getattr(it, per)
        first[key] = min(first.get(key, it.start), it.start)
        last[key] = max(last.get(key, it.start + it.us), it.start + it.us)
    return sum(last[k] - first[k] for k in first)


def kernel_table(trace: dict, top: int = 5) -> list[dict]:
    """The ``top`` kernels (CUDA) or operators (CPU, by self time) of each mode and stage, as rows
    ``{mode, stage, kernel | op, calls/step, ms/step, % of stage}`` (``% of stage``: of the stage's
    summed device time, or self time on a CPU; stage ``other``: a step's work outside every stage;
    a kernel name cut to :data:`NAME_WIDTH` characters)."""
    attributed, on_device = _attribute(trace["traceEvents"])
    steps = _step_counts(trace["traceEvents"])
    what = "kernel" if on_device else "op"
    rows = []
    for mode in MODES:
        for label in [PREFIX + s for s in STAGES] + [BACKWARD, None]:
            items = attributed.get((mode, label))
            if not items:
                continue
            n, total = steps[mode], sum(it.us for it in items)
            by_name = defaultdict(lambda: [0, 0.0])
            for it in items:
                by_name[it.name][0] += 1
                by_name[it.name][1] += it.us
            ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
            for name, (calls, us) in ranked:
                short = name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."
                rows.append({"mode": mode, "stage": "other" if label is None else label[len(PREFIX):],
                             what: short, "calls/step": calls / n, "ms/step": us / n / 1e3,
                             "% of stage": 100 * us / total if total else 0.0})
    return rows


def _step_counts(events: list[dict]) -> dict[str, int]:
    """Profiled steps per mode (host step spans)."""
    counts = defaultdict(int)
    for e in _label_spans(events):
        if e["name"].startswith(STEP + "["):
            counts[e["name"][len(STEP) + 1:-1]] += 1
    return counts


def stage_table(trace: dict, device_type: int = 0) -> list[dict]:
    """Reduce a Chrome trace to rows ``{mode, stage, calls/step, ms/step, % of step, alloc MB, peak MB}``,
    with ``gpu ms/step`` (the device time of the work each stage launched) and ``gpu span ms/step`` (from
    the start of that work to its end, in each call of the stage; none for ``other``) when the trace
    has device work."""
    events = trace["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type)
    mem_ts = [m[0] for m in mem]
    spans = _label_spans(events)
    steps = [e for e in spans if e["name"].startswith(STEP + "[")]
    labels = [PREFIX + s for s in STAGES] + [BACKWARD]
    attributed, on_device = _attribute(events)

    def gpu(mode, labels, n, per):  # the device columns of the work these labels launched (none on a CPU)
        if not on_device:
            return {}
        items = [it for label in labels for it in attributed.get((mode, label), [])]
        return {"gpu ms/step": sum(it.us for it in items) / n / 1e3,
                "gpu span ms/step": _span_us(items, per) / n / 1e3 if per else None}

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
                         **gpu(mode, [label], n, "call"),
                         "alloc MB": sum(m[1] for m in mems) / n / 2**20, "peak MB": max(m[0] for m in mems) / 2**20})
        rows.append({"mode": mode, "stage": "other", "calls/step": None, "ms/step": (step_us - staged) / n / 1e3,
                     "% of step": 100 * (step_us - staged) / step_us, **gpu(mode, [None], n, None),
                     "alloc MB": None, "peak MB": None})
        rows.append({"mode": mode, "stage": "step", "calls/step": 1.0, "ms/step": step_us / n / 1e3,
                     "% of step": 100.0, **gpu(mode, [*labels, None], n, "step"),
                     "alloc MB": sum(m[1] for m in step_mem) / n / 2**20,
                     "peak MB": max(m[0] for m in step_mem) / 2**20})
    return rows
