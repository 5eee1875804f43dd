"""Stage labels: present in the exported trace of every layer, invisible to torch.compile."""
import json

import pytest
import torch
from torch._dynamo.utils import counters

from ovqflex.bench.profiler import ProfileConfig, kernel_table, profile_target, stage_table
from ovqflex.cli import main
from ovqflex.ops import ovq_program
from ovqflex.profiling import STAGES, stage, stage_timer

SMALL = dict(backend="blocked", block_size=32)
# target -> (layer options, stages its forward must show); adding a layer (e.g. kvm) is one line
LAYERS = {
    "ovq": (dict(SMALL, chunk_size=32, max_centroids=32), STAGES),
    "kvm": (dict(SMALL, chunk_size=32, budget="power_law", growth_factor=4.0, max_state_chunks=None), STAGES),
    "swa": (dict(SMALL, window=16), ("proj", "block_mask", "attention")),
}


@pytest.mark.parametrize("target", sorted(LAYERS))
def test_trace_is_a_chrome_trace_with_every_stage(tmp_path, target):
    options, stages = LAYERS[target]
    cfg = ProfileConfig(target=target, seq_len=96, heads=2, head_dim=8, options=options, steps=1, warmup=0,
                        kernels=1000)
    tables = profile_target(cfg, tmp_path / "trace.json")
    rows = tables.stages
    trace = json.loads((tmp_path / "trace.json").read_text())  # valid JSON
    events = trace["traceEvents"]
    assert isinstance(events, list) and all("ph" in e and "name" in e for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    names = {e["name"] for e in spans}
    for s in stages:
        assert f"ovqflex.{s}" in names, s
    assert {"ovqflex.step[fwd]", "ovqflex.step[fwd+bwd]", "ovqflex.backward"} <= names
    for mode in ("fwd", "fwd+bwd"):
        mine = {r["stage"]: r for r in rows if r["mode"] == mode}
        assert set(stages) <= set(mine) and mine["step"]["% of step"] == 100.0
        assert sum(mine[s]["ms/step"] for s in mine if s != "step") == pytest.approx(mine["step"]["ms/step"])
        assert "gpu ms/step" not in mine["step"]  # a CPU trace: no device work
        # every operator listed (kernels=1000) under the stage that ran it, by self time: within the stage's time
        ops = [r for r in tables.kernels if r["mode"] == mode]
        assert set(stages) <= {r["stage"] for r in ops} and all("op" in r and "kernel" not in r for r in ops)
        for s in stages:
            mine_ops = [r for r in ops if r["stage"] == s]
            assert sum(r["% of stage"] for r in mine_ops) == pytest.approx(100)
            assert 0 < sum(r["ms/step"] for r in mine_ops) <= mine[s]["ms/step"] * (1 + 1e-9)


def test_model_training_step_is_profiled(tmp_path):
    cfg = ProfileConfig(target="model", seq_len=64, batch=2, pattern="swa,ovq", modes=("fwd+bwd",), steps=1,
                        warmup=0, options=dict(backend="blocked", n_layers=2))
    rows = profile_target(cfg, tmp_path / "t.json").stages
    got = {r["stage"] for r in rows}
    assert set(STAGES) | {"backward", "step", "other"} <= got and {r["mode"] for r in rows} == {"fwd+bwd"}


def test_stage_table_from_a_known_trace():
    """A hand-written trace: one fwd step of 100 us holding proj [10, 30) and attention [40, 90);
    3 MB allocated before the step (at -5), then +5 MB at 15, -5 MB at 25, +8 MB at 50, +2 MB at 60; and
    100 MB on another device at 55 (a CPU table reads the CPU's allocator only). Peaks are above the level
    where a span began; allocations count the bytes allocated, not those freed."""
    mb = 2**20

    def mem(ts, total, delta, device=0):
        return {"ph": "i", "name": "[memory]", "ts": ts,
                "args": {"Total Allocated": total, "Bytes": delta, "Device Type": device}}

    events = [{"ph": "X", "name": "ovqflex.step[fwd]", "ts": 0, "dur": 100},
              {"ph": "X", "name": "ovqflex.proj", "ts": 10, "dur": 20},
              {"ph": "X", "name": "ovqflex.attention", "ts": 40, "dur": 50},
              mem(-5, 3 * mb, 3 * mb), mem(15, 8 * mb, 5 * mb), mem(25, 3 * mb, -5 * mb), mem(50, 11 * mb, 8 * mb),
              mem(55, 100 * mb, 100 * mb, device=1), mem(60, 13 * mb, 2 * mb)]
    rows = {r["stage"]: r for r in stage_table({"traceEvents": events})}
    assert rows["proj"]["ms/step"] == pytest.approx(0.02) and rows["proj"]["peak MB"] == pytest.approx(5)
    assert rows["proj"]["alloc MB"] == pytest.approx(5)
    assert rows["attention"]["% of step"] == pytest.approx(50) and rows["attention"]["peak MB"] == pytest.approx(10)
    assert rows["attention"]["alloc MB"] == pytest.approx(10)
    assert rows["other"]["ms/step"] == pytest.approx(0.03) and rows["step"]["peak MB"] == pytest.approx(10)


def _host(name, ts, dur, cat="user_annotation"):
    """A labelled span of a hand-written trace (host time; ``gpu_user_annotation``: the device's copy)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _launch(name, ts, corr, cat="cuda_runtime"):
    """A host call launching device work with correlation id ``corr``."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _kernel(name, ts, dur, corr, cat="kernel"):
    """Device work (a kernel; ``gpu_memcpy``: a copy) of the launch with correlation id ``corr``."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _cuda_trace():
    """A hand-written CUDA trace: one fwd step [0, 100) holding routing [10, 40) and attention [50, 90)
    on the host, each label repeated on the device timeline (``gpu_user_annotation``, not host time).
    Launches (correlation id -> host time): a kernel in routing (1, t=12), a CUDA graph replay in
    routing whose four kernels share its id (2, t=20), a copy in routing (6, t=30), a kernel in
    attention (3, t=60), a driver launch outside the stages (4, t=95); kernel 5 has no launch."""
    return {"traceEvents": [
        _host("ovqflex.step[fwd]", 0, 100), _host("ovqflex.routing", 10, 30), _host("ovqflex.attention", 50, 40),
        _host("ovqflex.step[fwd]", 150, 160, "gpu_user_annotation"),
        _host("ovqflex.routing", 150, 60, "gpu_user_annotation"),
        _launch("cudaLaunchKernel", 12, 1), _launch("cudaGraphLaunch", 20, 2), _launch("cudaMemcpyAsync", 30, 6),
        _launch("cudaLaunchKernel", 60, 3), _launch("cuLaunchKernel", 95, 4, "cuda_driver"),
        _kernel("layer_norm", 150, 4, 1), *(_kernel("triton_argmax", 160 + 10 * i, 5, 2) for i in range(3)),
        _kernel("sgemm_" + "x" * 100, 200, 10, 2), _kernel("Memcpy DtoD", 215, 1, 6, "gpu_memcpy"),
        _kernel("flex_attention", 230, 30, 3), _kernel("tail", 300, 2, 4), _kernel("orphan", 305, 7, 5)]}


def test_kernel_table_from_a_known_cuda_trace():
    """Kernels go to the stage whose host span holds their launch (all of a graph replay's to its
    ``cudaGraphLaunch``'s), ranked by device time; names are cut; an unlaunched kernel is dropped."""
    rows = kernel_table(_cuda_trace(), top=3)
    routing = [r for r in rows if r["stage"] == "routing"]
    assert [r["kernel"] for r in routing] == ["triton_argmax", "sgemm_" + "x" * 63 + "...", "layer_norm"]
    assert [r["calls/step"] for r in routing] == [3, 1, 1]
    assert [r["ms/step"] for r in routing] == pytest.approx([0.015, 0.010, 0.004])
    assert [r["% of stage"] for r in routing] == pytest.approx([50, 100 / 3, 400 / 30])
    assert [(r["stage"], r["kernel"], r["ms/step"]) for r in rows if r["stage"] != "routing"] == [
        ("attention", "flex_attention", pytest.approx(0.03)), ("other", "tail", pytest.approx(0.002))]


def test_stage_table_of_a_cuda_trace_adds_the_device_time_each_stage_launched():
    """Busy time sums the work's device time; the span runs from its first start to its last end:
    routing's kernels and copy [150, 216) hold 30 us of work in a 66 us span (gaps between them)."""
    rows = {r["stage"]: r for r in stage_table(_cuda_trace(), device_type=1)}
    assert rows["step"]["calls/step"] == 1 and rows["step"]["ms/step"] == pytest.approx(0.1)  # host spans only
    assert rows["routing"]["ms/step"] == pytest.approx(0.03) and rows["routing"]["gpu ms/step"] == pytest.approx(0.03)
    assert rows["routing"]["gpu span ms/step"] == pytest.approx(0.066)
    assert rows["attention"]["gpu ms/step"] == pytest.approx(0.03)
    assert rows["attention"]["gpu span ms/step"] == pytest.approx(0.03)
    assert rows["other"]["gpu ms/step"] == pytest.approx(0.002) and rows["other"]["gpu span ms/step"] is None
    assert rows["step"]["gpu ms/step"] == pytest.approx(0.062)
    assert rows["step"]["gpu span ms/step"] == pytest.approx(0.152)  # [150, 302): the unlaunched kernel is left out


def test_gpu_span_is_taken_per_call_of_a_stage():
    """A stage called twice in a step (a model's layers) spans each call's own work: two routing calls
    whose kernels run [100, 110) and [200, 205), with an attention kernel [150, 190) between them."""
    events = [_host("ovqflex.step[fwd]", 0, 100), _host("ovqflex.routing", 10, 10),
              _host("ovqflex.attention", 30, 10), _host("ovqflex.routing", 50, 10),
              *(_launch("cudaLaunchKernel", ts, corr) for ts, corr in [(12, 1), (14, 2), (32, 3), (52, 4)]),
              *(_kernel(f"k{corr}", ts, dur, corr) for ts, dur, corr in [(100, 4, 1), (106, 4, 2), (150, 40, 3),
                                                                          (200, 5, 4)])]
    rows = {r["stage"]: r for r in stage_table({"traceEvents": events}, device_type=1)}
    assert rows["routing"]["calls/step"] == 2 and rows["routing"]["gpu ms/step"] == pytest.approx(0.013)
    assert rows["routing"]["gpu span ms/step"] == pytest.approx(0.015)  # 10 + 5 us, not [100, 205)
    assert rows["step"]["gpu span ms/step"] == pytest.approx(0.105)


def test_operator_self_times_subtract_their_children():
    """Host operators A [0, 50) calling B [5, 15), H [15, 18) (starting as B ends: B's sibling, not its child)
    and C [20, 40), C calling D [25, 30); F [60, 70) calling G [60, 65) (one start: the longer is the caller,
    whichever the trace lists first); E [22, 32) on another thread. A routing stage [0, 80) holds a state_build
    stage [20, 45): an operator goes to the innermost stage open when it starts."""
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [{"ph": "X", "cat": "user_annotation", "name": "ovqflex.step[fwd]", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "user_annotation", "name": "ovqflex.routing", "ts": 0, "dur": 80},
              {"ph": "X", "cat": "user_annotation", "name": "ovqflex.state_build", "ts": 20, "dur": 25},
              op("A", 0, 50), op("B", 5, 10), op("H", 15, 3), op("C", 20, 20), op("D", 25, 5), op("E", 22, 10, tid=2),
              op("G", 60, 5), op("F", 60, 10)]
    rows = kernel_table({"traceEvents": events}, top=10)
    assert {r["op"]: r["ms/step"] * 1e3 for r in rows} == pytest.approx(
        {"A": 17, "B": 10, "H": 3, "C": 15, "D": 5, "E": 10, "F": 5, "G": 5})
    assert {r["op"]: r["stage"] for r in rows} == {"A": "routing", "B": "routing", "H": "routing", "F": "routing",
                                                    "G": "routing", "C": "state_build", "D": "state_build",
                                                    "E": "state_build"}


def test_stage_labels_do_not_break_fullgraph_compile():
    """dynamo treats record_function as a no-op context (the layers' own fullgraph tests in
    layers/test_ovq.py / layers/test_plain.py compile them with these labels inside)."""
    counters.clear()

    def f(x):
        with stage("proj"):
            y = x * 2
        with stage("attention"):
            return y.sin()

    out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(4))
    assert torch.allclose(out, torch.ones(4).mul(2).sin()) and not counters["graph_break"]


def test_while_compiling_a_stage_is_no_label_and_no_timer(monkeypatch):
    """Traced by dynamo (``torch.compiler.is_compiling()``), a stage is a plain ``nullcontext``: no
    ``record_function``, which dynamo would ignore with a warning, and no timing, even inside a timer."""
    import contextlib

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with stage_timer() as totals:
        label = stage("proj")
        with label:
            pass
    assert type(label) is contextlib.nullcontext and totals == {}


def test_stage_timer_times_each_stage_of_a_program_build(monkeypatch):
    """Inside a timer each stage adds its wall time (clock mocked: each reading 1 s later), a
    nested timer takes the stages run inside it, and outside a timer nothing is timed."""
    import ovqflex.profiling as profiling

    clock = iter(range(1000))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: float(next(clock)))
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with stage_timer() as outer:
        ovq_program(q, k, v, torch.ones(2), chunk_size=16, max_centroids=8)
        with stage_timer() as inner:
            with stage("attention"):
                pass
            with stage("attention"):
                pass
    assert outer == {"proj": 1.0, "routing": 1.0, "state_build": 1.0, "block_mask": 1.0}
    assert inner == {"attention": 2.0}
    with stage("attention"):
        pass
    assert next(clock) == 12, "a stage outside a timer read the clock"


def test_a_timed_stage_syncs_the_device_around_its_work_and_keeps_its_profiler_label(monkeypatch):
    """Inside a :func:`stage_timer` a stage synchronizes the device before and after its work (a CUDA stage's
    time is its kernels'), and the profiler still sees its label."""
    import ovqflex.profiling as profiling

    events = []
    monkeypatch.setattr(profiling.devices, "sync", lambda device: events.append(("sync", device.type)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with stage_timer("cpu") as totals:
            with stage("proj"):
                events.append("work")
                torch.ones(8).mul(2)
    assert events == [("sync", "cpu"), "work", ("sync", "cpu")] and set(totals) == {"proj"}
    assert "ovqflex.proj" in {e.key for e in prof.key_averages()}


def test_unknown_stage_name():
    with pytest.raises(ValueError, match="stage name must be one of"):
        stage("routeing")


@pytest.mark.parametrize("argv, match", [(["profile", "kvm2"], "target must be 'model' or one of"),
                                         (["profile", "swa", "--steps", "0"], "steps must be >= 1"),
                                         (["profile", "swa", "--opt", "windw=3"], "bad option for target 'swa'"),
                                         (["profile", "swa", "--kernels", "-1"], "kernels must be >= 0, got -1"),
                                         (["profile", "swa", "--warmup", "-1"], "warmup must be >= 0, got -1")],
                         ids=["target", "steps", "option", "kernels", "warmup"])
def test_cli_profile_bad_arguments(tmp_path, capsys, argv, match):
    assert main([*argv, "--trace", str(tmp_path / "t.json")]) == 2
    assert match in capsys.readouterr().err


def test_no_modes_are_refused():
    with pytest.raises(ValueError, match=r"modes must be a non-empty subset of \('fwd', 'fwd\+bwd'\), got \(\)"):
        ProfileConfig(modes=())


def test_cli_profile_prints_the_table_and_writes_the_trace(tmp_path, capsys):
    trace = tmp_path / "swa.json"
    argv = ["profile", "swa", "--seq-len", "64", "--batch", "1", "--heads", "2", "--head-dim", "8",
            "--opt", "backend=blocked", "--opt", "window=16", "--opt", "block_size=32", "--mode", "fwd",
            "--steps", "1", "--warmup", "0", "--seed", "1", "--device", "cpu", "--trace", str(trace)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("layer swa, x [1, 64, ...], 1 profiled steps per mode, device cpu\n")
    assert "block_mask" in out and "attention" in out and "peak MB" in out and f"wrote {trace}" in out
    assert "top 5 operators by self time, per stage:" in out and "% of stage" in out
    assert "ovqflex.attention" in {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}


def test_cli_profile_names_a_models_preset_and_pattern_and_a_cuda_traces_kernels(tmp_path, capsys, monkeypatch):
    """The header names the model (preset, pattern) a ``model`` target profiles; the second table is the
    kernels by device time where the rows are kernels (a CUDA trace), the operators by self time otherwise.
    ``profile_target`` is stood in for (no GPU here)."""
    from ovqflex import devices
    from ovqflex.bench import profiler
    from ovqflex.bench.profiler import ProfileTables

    seen = []
    kernel_rows = [{"stage": "attention", "kernel": "flex_fwd", "ms/step": 0.5}]
    monkeypatch.setattr(profiler, "profile_target",
                        lambda cfg, trace: seen.append((cfg.target, cfg.preset, trace)) or ProfileTables(
                            [{"mode": "fwd", "stage": "attention", "ms/step": 1.0}], kernel_rows))
    monkeypatch.setattr(devices, "resolve_device", lambda device: torch.device("cuda", 0))  # the header's device
    trace = str(tmp_path / "t.json")
    assert main(["profile", "model", "--preset", "tiny", "--pattern", "swa,ovq", "--kernels", "3", "--device", "cpu",
                 "--trace", trace]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model tiny swa,ovq, x [") and ", device cuda:0\n" in out
    assert seen == [("model", "tiny", trace)]
    assert "top 3 kernels by device time, per stage:" in out and "flex_fwd" in out
    kernel_rows[:] = [{"stage": "attention", "op": "aten::mm", "ms/step": 0.5}]
    assert main(["profile", "swa", "--device", "cpu", "--trace", trace]) == 0
    assert "top 5 operators by self time, per stage:" in capsys.readouterr().out


def test_each_mode_counts_its_own_steps_and_a_stage_peaks_at_its_largest_call():
    """A CPU trace of two modes: fwd [0, 100) calls routing twice, [10, 30) allocating 2 MB and [40, 60)
    6 MB (each freed before it ends); fwd+bwd [200, 400) calls it once, [210, 290). Operators: aten::mm in
    fwd's routing, aten::add in fwd+bwd's, aten::stray outside every step (left out, not put in a step)."""
    mb = 2**20

    def mem(ts, total, delta):
        return {"ph": "i", "name": "[memory]", "ts": ts, "args": {"Total Allocated": total, "Bytes": delta,
                                                                  "Device Type": 0}}

    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    events = [_host("ovqflex.step[fwd]", 0, 100), _host("ovqflex.routing", 10, 20), _host("ovqflex.routing", 40, 20),
              _host("ovqflex.step[fwd+bwd]", 200, 200), _host("ovqflex.routing", 210, 80),
              mem(15, 2 * mb, 2 * mb), mem(25, 0, -2 * mb), mem(45, 6 * mb, 6 * mb), mem(55, 0, -6 * mb),
              op("aten::mm", 12, 8), op("aten::add", 220, 10), op("aten::stray", 500, 10)]
    rows = {(r["mode"], r["stage"]): r for r in stage_table({"traceEvents": events})}
    fwd, both = rows[("fwd", "routing")], rows[("fwd+bwd", "routing")]
    assert (fwd["calls/step"], fwd["ms/step"], fwd["peak MB"], fwd["alloc MB"]) == (2, pytest.approx(0.04), 6, 8)
    assert (both["calls/step"], both["ms/step"], both["peak MB"]) == (1, pytest.approx(0.08), 0)
    assert rows[("fwd", "other")]["ms/step"] == pytest.approx(0.06)
    ops = [(r["mode"], r["stage"], r["op"], r["ms/step"]) for r in kernel_table({"traceEvents": events}, top=5)]
    assert ops == [("fwd", "routing", "aten::mm", pytest.approx(0.008)),
                   ("fwd+bwd", "routing", "aten::add", pytest.approx(0.01))]


def test_the_fwd_mode_runs_without_grad_and_fwd_bwd_with_it():
    """``fwd`` profiles inference (no autograd graph, what ``auto`` sends to flex); ``fwd+bwd`` a training step."""
    from ovqflex.bench.profiler import _step

    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return super().forward(x)

    torch.manual_seed(0)
    layer = Probe(4, 4)
    x = torch.randn(2, 4)
    _step(layer, x, lambda y, _: y.square().mean(), "fwd")
    assert seen == [False] and layer.weight.grad is None
    _step(layer, x, lambda y, _: y.square().mean(), "fwd+bwd")
    assert seen == [False, True] and layer.weight.grad is None  # its gradients cleared after the step
