"""Bench profiles: every scenario table is checked against its kind's schema before anything runs."""
import re
from pathlib import Path

import pytest
import torch

import ovqflex
from ovqflex.bench.runner import load_profile
from ovqflex.bench.scenarios import KINDS, Scenario, parse_scenario
from ovqflex.cli import main

PROFILES = sorted((Path(__file__).parents[3] / "profiles").glob("*.toml"))


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_shipped_profiles_parse(path):
    prof = load_profile(path)
    assert all(isinstance(sc, KINDS[sc.kind][0]) for sc in prof["scenario"])


def test_every_kind_has_a_schema():
    assert {"blockmask", "ovq", "kvm", "vq", "train", "viz", "recurrent", "state_layout", "routing", "decode",
            "quantized", "generate", "stages"} <= set(KINDS)
    assert all(issubclass(schema, Scenario) and callable(fn) for schema, fn in KINDS.values())


OVQ = 'name = "p"\n[[scenario]]\nname = "s"\nkind = "ovq"\n'
DECODE = ('[[scenario]]\nname = "d"\nkind = "decode"\nseq_lens = [64]\n'
          '[[scenario.cases]]\nname = "ovq"\nkind = "ovq"\nchunk_size = 16\n')
GENERATE = '[[scenario]]\nname = "g"\nkind = "generate"\n'
ROUTING = '[[scenario]]\nname = "r"\nkind = "routing"\nseq_lens = [64]\n'
STAGES = '[[scenario]]\nname = "st"\nkind = "stages"\nseq_lens = [64]\n'


def _in(name: str, kind: str) -> str:
    """The start of an error about scenario ``name`` of a profile, after its index and file."""
    return rf"\('{name}'\) of .* \(kind '{kind}'\): "


IN_D, IN_G, IN_R, IN_ST = _in("d", "decode"), _in("g", "generate"), _in("r", "routing"), _in("st", "stages")


@pytest.mark.parametrize("text, match", [
    (OVQ + "seq_len = [64]\nmax_centroids = 8\n",
     r"scenario 0 \('s'\) of '.*' \(kind 'ovq'\): unknown key 'seq_len' \(did you mean 'seq_lens'\?\)"),
    (OVQ + "seq_lens = [64]\nmax_centriods = 8\n", r"unknown key 'max_centriods' \(did you mean 'max_centroids'\?\)"),
    (OVQ + "seq_lens = [64]\nmax_centroids = 8\ncolour = 1\n", r"unknown key 'colour'; known keys: checkpoint_every, chunk_size, "),
    (OVQ + "seq_lens = [64]\n", r"\(kind 'ovq'\): missing key 'max_centroids'"),
    (OVQ + "seq_lens = 64\nmax_centroids = 8\n", r"seq_lens must be list\[int\], got int 64"),
    (OVQ + "seq_lens = [64]\nmax_centroids = 8.5\n", r"max_centroids must be int, got float 8.5"),
    ('descripton = "x"\n' + OVQ + "seq_lens = [64]\nmax_centroids = 8\n",
     r"unknown key 'descripton' \(did you mean 'description'\?\)"),
    (DECODE + "max_centriods = 8\n", r"case 0 \(a OVQAttention\): unknown key 'max_centriods' "
                                     r"\(did you mean 'max_centroids'\?\)"),
    (DECODE.replace('kind = "ovq"\nchunk', 'kind = "lstm"\nchunk'), r"case 0: kind must be one of"),
    (DECODE + 'decode = "fast"\n', r"case 0: decode must be one of \['compiled', 'functional', 'graph', 'static'\]"),
    ('[[scenario]]\nkind = "kvm"\nseq_lens = [64]\nbudget = "power_law"\ngrowth_factr = 4.0\n',
     r"unknown key 'growth_factr' \(did you mean 'growth_factor'\?\)"),
    (DECODE.replace("seq_lens = [64]\n", "seq_lens = [64]\nbatch_sizes = [0]\n"),
     IN_D + r"batch_sizes\[0\] must be >= 1, got 0"),
    (DECODE.replace("seq_lens = [64]\n", "seq_lens = [64]\nbatch_sizes = []\n"),
     IN_D + r"batch_sizes must list at least one size"),
    (DECODE.replace("seq_lens = [64]\n", "seq_lens = [64]\nbatch_size = [2]\n"),
     r"unknown key 'batch_size' \(did you mean 'batch_sizes'\?\)"),
    (GENERATE + "batch_sizes = [0]\n", IN_G + r"batch_sizes\[0\] must be >= 1, got 0"),
    (GENERATE + "prompt_lens = [64, -1]\n", IN_G + r"prompt_lens\[1\] must be >= 1, got -1"),
    (GENERATE + 'decodes = ["functional", "fast"]\n',
     IN_G + r"decodes must be one of \['compiled', 'functional', 'graph', 'static'\], got 'fast'"),
    (GENERATE + 'decodes = ["static", "static"]\n', IN_G + r"decodes must list distinct decodes"),
    (GENERATE + "new_tokens = 1\n", IN_G + r"new_tokens must be >= 2, got 1"),
    (GENERATE + "new_tokns = 8\n", r"unknown key 'new_tokns' \(did you mean 'new_tokens'\?\)"),
    (GENERATE + 'preset = "huge"\n', IN_G + r"preset must be one of \["),
    (ROUTING + 'method = "vq"\n', IN_R + r"method must be one of \['kvm', 'ovq'\], got 'vq'"),
    (ROUTING + 'method = "kvm"\nbudgt = "power_law"\n', r"unknown key 'budgt' \(did you mean 'budget'\?\)"),
    (OVQ + 'seq_lens = [64]\nmax_centroids = 8\ndtype = "fp16"\n', r"dtype must be one of \['bf16', 'fp32'\], got 'fp16'"),
    (OVQ + 'seq_lens = [64]\nmax_centroids = 8\ncompile_shapes = "symbolic"\n',
     r"compile_shapes must be one of \['dynamic', 'static'\], got 'symbolic'"),
    (OVQ + "seq_lens = []\nmax_centroids = 8\n", r"seq_lens must list at least one size"),
    (STAGES + 'method = "linear"\n',
     IN_ST + r"method must be one of \['kvm', 'ovq', 'vq'\], got 'linear'"),
    (STAGES + 'layouts = ["auto"]\n', r"layouts\[0\] must be one of \['snapshot', 'versioned'\], got 'auto'"),
], ids=["seq_len", "max_centriods", "unknown", "missing", "type-list", "type-int", "profile-key", "decode-case",
        "decode-kind", "decode-mode", "kvm-budget", "decode-batch-0", "decode-batch-empty",
        "decode-batch-key", "generate-batch-0", "generate-prompt", "generate-decode", "generate-decode-twice",
        "generate-new-tokens", "generate-key", "generate-preset", "routing-method",
                                 "routing-kvm-key", "op-dtype", "op-compile-shapes", "op-no-lengths", "stages-method",
                                 "stages-layout"])
def test_bad_scenario_keys_are_named(tmp_path, capsys, text, match):
    prof = tmp_path / "bad.toml"
    prof.write_text(text)
    with pytest.raises((ValueError, TypeError), match=match):
        load_profile(prof)
    assert main(["bench", str(prof), "--out", str(tmp_path / "out")]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # refused before anything ran


KINDS_TABLE = '[[scenario]]\nname = "s"\nkind = "{}"\n'.format
BAD_VALUES = [  # kind, keys, the error: each had been accepted until its scenario ran
    ("ovq", "seq_lens = [64]\nmax_centroids = 8\nchunk_size = 100\n",
     "chunk_size must be a positive multiple of 16, got 100"),
    ("ovq", "seq_lens = [64]\nmax_centroids = 8\nheads = 0\n", "heads must be >= 1, got 0"),
    ("ovq", "seq_lens = [64]\nmax_centroids = 8\nrepeats = -1\n", "repeats must be >= 1, got -1"),
    ("kvm", 'seq_lens = [64]\nbudget = "sqrt"\n', r"budget must be one of \[.*'power_law'.*\], got 'sqrt'"),
    ("vq", "seq_lens = [64]\ncodebook_size = 0\n", "codebook_size must be >= 1, got 0"),
    ("routing", 'seq_lens = [64]\nmethod = "kvm"\nbudget = "power_law"\ngrowth_factor = -1.0\n',
     "growth_factor must be a finite number >= 0, got -1.0"),
    ("stages", 'seq_lens = [64]\nlayouts = []\n', r"layouts must list at least one item, got \[\]"),
    ("stages", 'seq_lens = [64]\nbudget = "power_law"\n',
     r"budget = 'power_law' is read by method 'kvm' alone; this scenario's method is 'ovq'"),
    ("state_layout", 'seq_lens = [64]\nmethod = "kvm"\ncodebook_size = 64\n',
     r"codebook_size = 64 is read by method 'vq' alone; this scenario's method is 'kvm'"),
    ("routing", 'seq_lens = [64]\nmethod = "kvm"\nmax_centroids = 64\n',
     r"max_centroids = 64 is read by method 'ovq' alone; this scenario's method is 'kvm'"),
    ("state_layout", 'seq_lens = [64]\nbackend = "cuda"\n', r"backend must be one of \[.*'flex'\], got 'cuda'"),
    ("state_layout", 'seq_lens = [64]\nblock_size = 100\n', r"block_size must be a power of two >= 16"),
    ("recurrent", 'seq_lens = [64]\nvla_chunk = 0\n', "vla_chunk must be >= 1, got 0"),
    ("recurrent", 'seq_lens = [64]\novq_backend = "fast"\n', r"ovq_backend must be one of"),
    ("blockmask", "seq_len = 512\nchunk_size = 100\nstate_rows = 64\n", "chunk_size must be a positive multiple of 16"),
    ("viz", 'seq_lens = [64]\nmethod = "ovqq"\n', r"method must be one of \[.*'ovq'"),
    ("viz", 'seq_lens = [64]\nmethod = "swa"\noptions = {windw = 3}\n', r"bad option for method 'swa'.*'windw'"),
    ("decode", "seq_lens = [64]\nheads = 0\n[[scenario.cases]]\nname = \"o\"\nkind = \"ovq\"\n",
     "heads must be >= 1, got 0"),
    ("decode", "seq_lens = [64]\n[[scenario.cases]]\nname = \"o\"\nkind = \"ovq\"\nchunk_size = 100\n",
     r"case 0 \('o'\): chunk_size must be a positive multiple of 16, got 100"),
    ("generate", 'pattern = "swa,ovqq"\n', r"pattern names unknown mixer 'ovqq'"),
    ("quantized", 'preset = "huge"\n', r"preset must be one of \["),
    ("train", 'patterns = []\nseq_len = 64\n', r"patterns must list at least one item"),
    ("train", 'patterns = ["swa,ovq"]\nseq_len = 64\nmodel_options = {chunk_size = 100}\n',
     "chunk_size must be a positive multiple of 16, got 100"),
    ("train", 'patterns = ["swa,ovq"]\nseq_len = 64\ntask_options = {n_querys = 2}\n',
     r"unknown key 'n_querys' \(did you mean 'n_queries'\?\)"),
    ("train", 'patterns = ["swa,ovq"]\nseq_len = 100000\n', "training length 100000 is too long for task 'icr'"),
]


@pytest.mark.parametrize("kind, keys, match", BAD_VALUES, ids=[
    "ovq-chunk_size", "ovq-heads", "ovq-repeats", "kvm-budget", "vq-codebook_size", "routing-growth_factor",
    "stages-layouts", "stages-kvm-key-of-ovq", "state_layout-vq-key-of-kvm", "routing-ovq-key-of-kvm",
    "state_layout-backend", "state_layout-block_size", "recurrent-vla_chunk", "recurrent-ovq_backend",
    "blockmask-chunk_size", "viz-method", "viz-options", "decode-heads", "decode-case-chunk_size", "generate-pattern",
    "quantized-preset", "train-patterns", "train-model_options", "train-task_options", "train-seq_len"])
def test_a_bad_value_is_refused_when_the_profile_loads(tmp_path, capsys, kind, keys, match):
    """Every scenario builds, when the profile loads, the options, layers and configs its run will
    build, and its ints must be >= 1 unless 0 has a meaning: a bad value in a profile's last scenario
    had been found after the scenarios before it ran (minutes of a lent GPU's time)."""
    test_bad_scenario_keys_are_named(tmp_path, capsys, KINDS_TABLE(kind) + keys, _in("s", kind) + ".*" + match)


@pytest.mark.parametrize("text, match", [
    (DECODE.replace('kind = "ovq"\nchunk', 'kind = "vq"\nchunk') + 'decode = "static"\n',
     r"case 0: decode='static' needs a static cache, which VQAttention has not"),
    (GENERATE + 'pattern = "swa,vq"\ndecodes = ["functional", "static"]\n',
     IN_G + r"decodes \['functional', 'static'\] need a static cache, which mixer 'vq' \(VQAttention\) has not"),
], ids=["decode", "generate"])
def test_a_static_decode_of_a_layer_without_a_static_cache_is_refused(tmp_path, capsys, monkeypatch, text, match):
    """As for a plugged-in method with a functional cache only (every built-in layer has a static one:
    VQ's is taken away here)."""
    monkeypatch.setattr(ovqflex.VQAttention, "static_cache_type", None)
    test_bad_scenario_keys_are_named(tmp_path, capsys, text, match)


def _run(table: dict) -> list[dict]:
    sc = parse_scenario(table, "test")
    return KINDS[sc.kind][1](sc, "cpu")


def test_op_scenario_times_forward_and_backward_against_sdpa_like_for_like():
    """bf16 inputs; the fwd+bwd cases (compiled through the backend that trains on the device: blocked
    on the CPU) are compared with SDPA's fwd+bwd and have no reference ratio (the loop is forward only).
    A length equal to ``max_reference_len`` / ``max_backward_len`` runs those cases. The FLOPs behind each
    GFLOP/s: causal attention's ``4 H D T (T + 1) / 2`` for SDPA, the method's count for the fused op and the
    loop, three times the forward's for a forward+backward."""
    from ovqflex.methods import get_method
    from ovqflex.ops.ovq import OVQOptions

    rows = _run({"kind": "ovq", "name": "o", "seq_lens": [64], "heads": 2, "head_dim": 16, "chunk_size": 16,
                 "max_centroids": 8, "dtype": "bf16", "repeats": 1, "max_reference_len": 64,
                 "max_backward_len": 64})
    by = {r["case"]: r for r in rows}
    assert list(by) == ["fused flex fwd, compiled op", "fused flex fwd, eager op", "sdpa causal fwd",
                        "reference loop fwd", "fused blocked fwd+bwd, compiled op", "fused blocked fwd+bwd, eager op",
                        "sdpa causal fwd+bwd"]
    assert all("error" not in r and r["dtype"] == "bf16" and r["T"] == 64 for r in rows), rows
    from ovqflex.bench.measure import matmul_gflops

    for name, r in by.items():
        # the efficiency's denominator is the run's one measured rate (the header's)
        assert r["pct_matmul_peak"] == pytest.approx(100 * r["gflops"] / matmul_gflops("cpu")), name
        sdpa = by["sdpa causal fwd+bwd" if "fwd+bwd" in name else "sdpa causal fwd"]
        assert r["x_vs_sdpa"] == pytest.approx(sdpa["time_s"] / r["time_s"]), name
        if "fwd+bwd" in name:
            assert r["x_vs_reference"] is None, name
        elif name != "sdpa causal fwd":
            assert r["x_vs_reference"] == pytest.approx(by["reference loop fwd"]["time_s"] / r["time_s"]), name
        forward = 4 * 2 * 16 * 64 * 65 / 2 if "sdpa" in name else get_method("ovq").flops(
            64, 2, 16, OVQOptions(chunk_size=16, max_centroids=8))
        assert r["gflops"] * r["time_s"] * 1e9 == pytest.approx(forward * (3 if "fwd+bwd" in name else 1)), name
    short = _run({"kind": "ovq", "name": "o", "seq_lens": [64], "heads": 2, "head_dim": 16, "chunk_size": 16,
                  "max_centroids": 8, "dtype": "bf16", "max_backward_len": 32, "max_reference_len": 32,
                  "repeats": 1})
    assert [r["case"] for r in short] == ["fused flex fwd, compiled op", "fused flex fwd, eager op", "sdpa causal fwd"]


def test_op_scenario_hands_its_checkpoint_spacing_to_the_op_not_the_reference(monkeypatch):
    """``checkpoint_every`` reaches every call of the op (recorded from the eager ones) and the rows; the
    reference loop, which has no layout, runs without it (it would refuse the keyword: an error row)."""
    import ovqflex.ops.ovq as ovq_ops

    seen, op = [], ovq_ops.ovq_attention

    def recording(*args, **kw):
        if not torch.compiler.is_compiling():
            seen.append(kw.get("checkpoint_every"))
        return op(*args, **kw)

    monkeypatch.setattr(ovq_ops, "ovq_attention", recording)
    rows = _run({"kind": "ovq", "name": "o", "seq_lens": [64], "heads": 2, "head_dim": 16, "chunk_size": 16,
                 "max_centroids": 8, "checkpoint_every": 2, "repeats": 1})
    assert all("error" not in r and r["checkpoint_every"] == 2 for r in rows), rows
    assert "reference loop fwd" in {r["case"] for r in rows}
    assert seen and set(seen) == {2}
    with pytest.raises(ValueError, match="checkpoint_every must be"):
        parse_scenario({"kind": "ovq", "name": "o", "seq_lens": [64], "max_centroids": 8, "checkpoint_every": -1},
                       "test")


def test_op_inputs_are_seeded_draws_in_the_scenarios_dtype():
    """q, k, v and a method's own inputs drawn from seed 0 on the CPU, every one in the scenario's dtype (bf16:
    the fp32 draw rounded); OVQ's and VQ's ``beta`` at ``sqrt(head_dim)``."""
    from ovqflex.bench.scenarios.op import kvm_extra, op_inputs, ovq_extra, vq_extra

    cpu, drawn = torch.device("cpu"), {}
    for name, extra in (("ovq", ovq_extra), ("kvm", kvm_extra), ("vq", vq_extra(8))):
        fp32, bf16 = (op_inputs(48, 2, 16, extra, cpu, dtype) for dtype in (torch.float32, torch.bfloat16))
        assert list(fp32) == list(bf16) and {"q", "k", "v"} < set(fp32)
        for key, x in bf16.items():
            assert x.dtype == torch.bfloat16 and torch.equal(x, fp32[key].to(torch.bfloat16)), (name, key)
        drawn[name] = fp32
    g = torch.Generator().manual_seed(0)
    assert torch.equal(drawn["ovq"]["q"], torch.randn(1, 2, 48, 16, generator=g))
    assert all(torch.equal(drawn[name]["beta"], torch.full((2,), 4.0)) for name in ("ovq", "vq"))


def test_kvm_keys_are_the_ops_options_and_its_rows_name_the_last_chunks_state(monkeypatch):
    """Every KVM key reaches :class:`~ovqflex.ops.kvm.KVMOptions` (0 for ``state_min_len`` and
    ``max_state_chunks``: their defaults, None); a KVM op row's ``state_rows_last_chunk`` is what the last
    query chunk at its length reads (power law 4 sqrt(ctx), chunks of 16: 0, 0, 16, 27 at T = 64); a row of
    the default-spaced op says ``checkpoint_every`` None."""
    import ovqflex.bench.scenarios.op as op_scenarios
    from ovqflex.bench.scenarios.op import KVMStateKeys

    keys = KVMStateKeys(n_bswa_chunks=3, sink_len=2, budget="saturation", state_min_len=32, growth_factor=2.0,
                        growth_exponent=0.25, round_down=4, saturation_n=100, max_state_chunks=5)
    assert keys.kvm_options(32) == dict(chunk_size=32, n_bswa_chunks=3, sink_len=2, budget="saturation",
                                        state_min_len=32, growth_factor=2.0, growth_exponent=0.25, round_down=4,
                                        saturation_n=100, max_state_chunks=5)
    defaults = KVMStateKeys(state_min_len=0, max_state_chunks=0).kvm_options(16)
    assert (defaults["state_min_len"], defaults["max_state_chunks"]) == (None, None)
    monkeypatch.setattr(op_scenarios, "_op_scenario", lambda sc, device, method, **kw: [{"T": T} for T in sc.seq_lens])
    rows = _run({"kind": "kvm", "name": "k", "seq_lens": [16, 64], "chunk_size": 16, "budget": "power_law",
                 "growth_factor": 4.0, "max_state_chunks": 0})
    assert [r["state_rows_last_chunk"] for r in rows] == [0, 27]
    monkeypatch.undo()
    rows = _run({"kind": "ovq", "name": "o", "seq_lens": [32], "heads": 2, "head_dim": 16, "chunk_size": 16,
                 "max_centroids": 8, "repeats": 1, "max_backward_len": 16, "max_reference_len": 16})
    assert rows and all(r["checkpoint_every"] is None for r in rows)


@pytest.mark.slow
def test_a_dynamic_op_scenario_compiles_nothing_after_its_second_length():
    """``compile_shapes = "dynamic"``: the compiled cases compile at the first length (static) and the second
    (a symbolic length), and run the third with no new graph (``graphs_first_call`` 0); the eager flex case
    compiles its flex kernel at every length. With ``"static"`` every compiled case compiles at every length."""
    table = {"kind": "ovq", "name": "o", "seq_lens": [256, 384, 640], "heads": 2, "head_dim": 16, "chunk_size": 64,
             "max_centroids": 64, "max_reference_len": 0, "repeats": 1}
    for shapes in ("dynamic", "static"):
        torch._dynamo.reset()  # each pass compiles from nothing
        rows = _run({**table, "compile_shapes": shapes})
        assert all("error" not in r and r["compile_shapes"] == shapes for r in rows), rows
        graphs = {(r["case"], r["T"]): r["graphs_first_call"] for r in rows}
        for case in ("fused flex fwd, compiled op", "fused blocked fwd+bwd, compiled op"):
            assert graphs[case, 256] >= 1 and graphs[case, 384] >= 1, (shapes, graphs)
            assert (graphs[case, 640] == 0) == (shapes == "dynamic"), (shapes, graphs)
        assert [graphs["fused flex fwd, eager op", T] for T in (256, 384, 640)] == [1, 1, 1], graphs


def _check_stages(rows, T, layouts):
    by = {r["case"]: r for r in rows}
    sdpa = by["sdpa causal fwd"]["time_s"]
    for layout in layouts:
        r = by[f"{layout} program + flex kernel"]
        assert r["T"] == T and r["routing_s"] > 0 and r["state_build_s"] > 0 and r["block_mask_s"] > 0, r
        assert r["program_saved_mb"] > 0 and r["kernel_first_call_s"] > 0, r  # (times of a loaded machine: no order)
        assert layout == "snapshot" or r["kernel_unrefined_s"] > 0, r
        assert r["kernel_x_vs_sdpa"] == pytest.approx(sdpa / r["kernel_s"])
        assert r["program_x_vs_sdpa"] == pytest.approx(sdpa / r["program_s"])
    (op,) = [r for r in rows if r["case"].startswith("op, flex, eager (auto: ")]
    return by, op


def test_stages_time_each_stage_per_layout_next_to_the_kernel_and_sdpa():
    """One row per layout (its stages, build, kernel, rows and blocks of the program it built), the op
    with the layout auto took, and SDPA; the rows of a layout are those of that layout's program."""
    from ovqflex.ops import ovq_program

    table = {"kind": "stages", "name": "st", "seq_lens": [64], "heads": 2, "head_dim": 16, "chunk_size": 16,
             "max_centroids": 8, "dtype": "fp32", "repeats": 1}
    rows = _run(table)
    by, op = _check_stages(rows, 64, ["snapshot", "versioned"])
    assert [r["case"] for r in rows][:2] == ["snapshot program + flex kernel", "versioned program + flex kernel"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    for layout in ("snapshot", "versioned"):
        p = ovq_program(q, k, v, torch.full((2,), 4.0), chunk_size=16, max_centroids=8, state_layout=layout)[0]
        r = by[f"{layout} program + flex kernel"]
        assert (r["kv_rows"], r["state_rows"], r["visible_blocks"], r["full_blocks"]) == \
            (p.geom.kv_len, p.geom.n_state, int(p.layout.visible_blocks()), int(p.layout.full_num.sum()))
        assert ("kernel_unrefined_s" in r) == (layout == "versioned")  # the versioned kernel, every block partial
    snap, ver = (by[f"{layout} program + flex kernel"] for layout in ("snapshot", "versioned"))
    per_row = [(r["program_s"] + r["kernel_s"]) / r["state_rows"] for r in (snap, ver)]
    assert ver["row_cost_vs_snapshot"] == pytest.approx(per_row[1] / per_row[0])
    assert "row_cost_vs_snapshot" not in snap
    auto = ovq_program(q, k, v, torch.full((2,), 4.0), chunk_size=16, max_centroids=8)[0].geom.kv_len
    took = "snapshot" if auto == by["snapshot program + flex kernel"]["kv_rows"] else "versioned"
    assert op["case"] == f"op, flex, eager (auto: {took})"
    assert op["x_vs_sdpa"] == pytest.approx(by["sdpa causal fwd"]["time_s"] / op["time_s"])


def test_stages_take_the_median_stage_time_and_time_the_unrefined_versioned_layout(monkeypatch):
    """Each stage's time is the median over ``repeats`` timed builds (a stand-in timer: 1, 2 and 6 s); the
    versioned program's kernel runs through flex on its own block layout and on the unrefined one
    (``build_block_layout(refine=False)``); causal SDPA runs on the scenario's bf16 inputs; every row
    names the dtype."""
    import contextlib

    from ovqflex.bench.scenarios import stages

    timed, layouts, attended, sdpa = [], [], [], []
    real_layout, real_attend, real_sdpa = (stages.build_block_layout, stages.attend,
                                           torch.nn.functional.scaled_dot_product_attention)

    @contextlib.contextmanager
    def stand_in_timer(device):
        times = {}
        yield times
        timed.append(device)
        times["routing"] = [1.0, 2.0, 6.0][len(timed) - 1]

    def recording_layout(*args, **kwargs):
        layouts.append((kwargs, real_layout(*args, **kwargs)))
        return layouts[-1][1]

    def recording_attend(program, backend):
        attended.append((program.layout, backend))
        return real_attend(program, backend)

    def recording_sdpa(q, k, v, **kwargs):
        sdpa.append((q.dtype, kwargs))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(stages, "stage_timer", stand_in_timer)
    monkeypatch.setattr(stages, "build_block_layout", recording_layout)
    monkeypatch.setattr(stages, "attend", recording_attend)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    rows = _run({"kind": "stages", "name": "st", "seq_lens": [64], "heads": 2, "head_dim": 16, "chunk_size": 16,
                 "max_centroids": 8, "layouts": ["versioned"], "dtype": "bf16", "repeats": 3})
    (row,) = [r for r in rows if r["case"] == "versioned program + flex kernel"]
    assert row["routing_s"] == 2.0 and len(timed) == 3
    ((kwargs, unrefined),) = layouts
    assert kwargs == {"refine": False}
    assert {id(layout) for layout, _ in attended} == {id(unrefined), id(attended[0][0])} and len(attended) > 2
    assert {backend for _, backend in attended} == {"flex"} and attended[0][0] is not unrefined
    assert sdpa and all(dtype == torch.bfloat16 and kw == {"is_causal": True} for dtype, kw in sdpa)
    assert [r["dtype"] for r in rows] == ["bf16"] * 3


def test_layout_of_names_a_programs_state_layout():
    from types import SimpleNamespace

    from ovqflex.bench.scenarios.stages import layout_of
    from ovqflex.ops import ovq_program

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    for layout in ("snapshot", "versioned"):
        program = ovq_program(q, k, v, torch.full((2,), 4.0), chunk_size=16, max_centroids=8, state_layout=layout)[0]
        assert layout_of(program) == layout
    assert layout_of(SimpleNamespace(regions=())) == "none"


#: a small state of each method: the keys only it reads (a scenario refuses another method's)
STATE_KEYS = {"ovq": dict(max_centroids=8), "kvm": dict(budget="power_law", growth_factor=4.0, max_state_chunks=0),
              "vq": dict(codebook_size=8)}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kvm", "vq"])
def test_stages_of_kvm_and_vq(method):
    table = {"kind": "stages", "name": "st", "method": method, "seq_lens": [64], "heads": 2, "head_dim": 16,
             "chunk_size": 16, "layouts": ["versioned"], "dtype": "bf16", "repeats": 1, **STATE_KEYS[method]}
    _check_stages(_run(table), 64, ["versioned"])


@pytest.mark.parametrize("method", ["ovq", "kvm", "vq"])
def test_state_layout_reports_each_layouts_rows_width_and_what_its_backward_keeps(monkeypatch, method):
    """Per layout, a forward and a forward+backward row with the state rows and list width of the program that
    layout builds (built here anew, with the scenario's options: OVQ's growth and checkpoint spacing too),
    what autograd keeps for the backward (the forward+backward rows only) and the ratios to the snapshot
    layout's row of the same case, whichever layout runs first. Every call runs on the scenario's backend;
    the inputs' gradients are cleared after each backward."""
    from ovqflex import attention
    from ovqflex.bench.scenarios import recurrent
    from ovqflex.bench.scenarios.op import kvm_extra, op_inputs, ovq_extra, vq_extra
    from ovqflex.ops import kvm_program, ovq_program, vq_program

    backends, leaves = [], []
    real_resolve, real_saved = attention.resolve_backend, recurrent.saved_for_backward_mb
    monkeypatch.setattr(attention, "resolve_backend",
                        lambda backend, program: backends.append(backend) or real_resolve(backend, program))
    monkeypatch.setattr(recurrent, "saved_for_backward_mb",
                        lambda fn, inputs: leaves.extend(inputs) or real_saved(fn, inputs))
    layouts = ["versioned", "snapshot"] if method == "ovq" else ["snapshot", "versioned"]
    # (OVQ's full growth: 192 snapshot rows, its plateau 160)
    ovq_keys = dict(growth="full", checkpoint_every=32, max_centroids=32) if method == "ovq" else {}
    table = {"kind": "state_layout", "name": "sl", "method": method, "seq_lens": [96], "heads": 2, "head_dim": 16,
             "chunk_size": 16, "block_size": 32, "repeats": 1, "layouts": layouts, **STATE_KEYS[method], **ovq_keys}
    rows = _run(table)
    assert [r["case"] for r in rows] == [f"{lay} blocked {what}" for lay in layouts for what in ("fwd", "fwd+bwd")]
    program_of, extra, options = {
        "ovq": (ovq_program, ovq_extra, ovq_keys),
        "kvm": (kvm_program, kvm_extra, dict(budget="power_law", growth_factor=4.0, max_state_chunks=None)),
        "vq": (vq_program, vq_extra(8), {})}[method]
    t = op_inputs(96, 2, 16, extra, torch.device("cpu"), torch.float32)
    by = {r["case"]: r for r in rows}
    for layout in layouts:
        p = program_of(**t, chunk_size=16, block_size=32, state_layout=layout, **options)[0]
        fwd, fwd_bwd = by[f"{layout} blocked fwd"], by[f"{layout} blocked fwd+bwd"]
        for r in (fwd, fwd_bwd):
            assert (r["state_rows"], r["listed_width"]) == (p.geom.n_state, p.layout.kv_idx.shape[-1]), r
            what = r["case"].rsplit(" ", 1)[1]
            assert r["x_time_vs_snapshot"] == pytest.approx(r["time_s"] / by[f"snapshot blocked {what}"]["time_s"])
        assert "saved_mb" not in fwd and fwd_bwd["saved_mb"] > 0
        assert fwd_bwd["x_saved_vs_snapshot"] == pytest.approx(
            fwd_bwd["saved_mb"] / by["snapshot blocked fwd+bwd"]["saved_mb"])
    assert backends and set(backends) == {"blocked"}
    assert leaves and all(x.grad is None for x in leaves)


def test_decode_runs_every_case_at_every_batch(capsys):
    """Rows for each (case, batch, T); tokens/s counts the tokens of all rows of the batch, and the
    speed-up is against the baseline at the same batch and T. A CUDA-graph case is left out on the CPU."""
    rows = _run({"kind": "decode", "name": "d", "seq_lens": [48], "batch_sizes": [1, 2], "hidden": 32, "heads": 2,
                 "decode_tokens": 4, "repeats": 1,
                 "cases": [{"name": "linear", "kind": "linear"},
                           {"name": "full-graph", "kind": "full", "decode": "graph"},
                           {"name": "full", "kind": "full"}]})
    left_out = "scenario 'd', case 'full-graph': decode 'graph' replays a CUDA graph, left out on cpu"
    assert left_out in capsys.readouterr().out
    assert [(r["case"], r["batch"], r["T"]) for r in rows] == [
        ("linear", 1, 48), ("linear", 2, 48), ("full", 1, 48), ("full", 2, 48)]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 4 / (4 * r["time_s"]))
        assert r["prefill_s"] > 0 and r["cache_mb"] > 0 and r["peak_mb"] >= 0
        full = next(f for f in rows if f["case"] == "full" and f["batch"] == r["batch"])
        assert r["x_vs_full"] == pytest.approx(r["tokens_per_s"] / full["tokens_per_s"])
    for case in ("linear", "full"):  # a state / KV cache per row of the batch
        one, two = (next(r for r in rows if r["case"] == case and r["batch"] == b) for b in (1, 2))
        assert two["cache_mb"] == pytest.approx(2 * one["cache_mb"], rel=0.05), case
    for r in rows:  # the cache after the decode: a state as large as after the prefill; a KV cache 4 tokens larger
        grown = 4 * (2 * r["batch"] * 32 * 4 + 8) if r["case"] == "full" else 0  # k, v fp32 rows; an int64 position
        assert (r["cache_mb"] - r["cache_mb_prefill"]) * 2**20 == grown, r
        assert r["rel_err_vs_forward"] < 1e-5 and r["compiled_graphs"] == 0, r  # eager, as the full forward


def test_decode_times_the_static_cache_eager_and_compiled(monkeypatch):
    """Every case decodes the same tokens (seed 0) through its layer in eval mode, initialised from seed 0;
    a static run takes the decode tokens in turn (16 untimed steps cross OVQ's first chunk boundary), its
    boundaries compiled where its step is; each run's outputs equal the full forward of what its cache took in."""
    from ovqflex.bench.scenarios import decode
    from ovqflex.layers import OVQAttention
    from ovqflex.methods import get_method

    seen, boundaries = [], []
    real_err, real_boundary = decode._rel_err_vs_forward, OVQAttention.static_boundary

    def recording_err(layer, x, T, taken, out):
        seen.append((layer, x, list(taken)))
        return real_err(layer, x, T, taken, out)

    def recording_boundary(self, cache, position, *, compile=False):
        boundaries.append((self, compile))
        return real_boundary(self, cache, position, compile=compile)

    monkeypatch.setattr(decode, "_rel_err_vs_forward", recording_err)
    monkeypatch.setattr(OVQAttention, "static_boundary", recording_boundary)
    ovq = {"kind": "ovq", "chunk_size": 16, "max_centroids": 32}
    rows = _run({"kind": "decode", "name": "d", "seq_lens": [48], "batch_sizes": [1], "hidden": 32, "heads": 2,
                 "decode_tokens": 4, "repeats": 1,
                 "cases": [{"name": "ovq-static", **ovq, "decode": "static"},
                           {"name": "ovq-compiled", **ovq, "decode": "compiled"},
                           {"name": "full-static", "kind": "full", "decode": "static"},
                           {"name": "full-compiled", "kind": "full", "decode": "compiled"},
                           {"name": "full", "kind": "full"}]})
    assert [(r["case"], r["decode"]) for r in rows] == [("ovq-static", "static"), ("ovq-compiled", "compiled"),
                                                        ("full-static", "static"), ("full-compiled", "compiled"),
                                                        ("full", "functional")]
    assert all("error" not in r and r["tokens_per_s"] > 0 and r["rel_err_vs_forward"] < 1e-5 for r in rows), rows
    assert rows[0]["cache_mb"] == rows[1]["cache_mb"]
    assert [r["compiled_graphs"] > 0 for r in rows] == [False, True, False, True, False]  # full: the step alone

    x = torch.randn(1, 52, 32, generator=torch.Generator().manual_seed(0))
    for (layer, seen_x, taken), case in zip(seen, ["ovq", "ovq", "full", "full", "full"]):
        assert torch.equal(seen_x, x) and not layer.training
        torch.manual_seed(0)
        options = {"backend": "flex", **{k: v for k, v in ovq.items() if k != "kind"}} if case == "ovq" else {}
        fresh = get_method(case).build(32, 2, **options)
        assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), fresh.state_dict().values()))
    static_taken, functional_taken = seen[0][2], seen[4][2]
    assert len(static_taken) > 16 and static_taken == [48 + i % 4 for i in range(len(static_taken))]
    assert functional_taken == [48, 49, 50, 51]
    compiled_of = {}
    for layer, compile in boundaries:
        compiled_of.setdefault(id(layer), set()).add(compile)
    assert [compiled_of[id(seen[i][0])] for i in (0, 1)] == [{False}, {True}]


def test_static_decode_compiles_its_chunk_boundary_before_the_timed_runs(monkeypatch):
    """With fewer decode tokens than a chunk, the first chunk boundary (whose compiled routing step
    compiles once per cache bound) would fall in a timed run: the static run crosses one untimed."""
    from ovqflex.bench.scenarios import decode

    seen, real = [], decode.measure

    def recording_measure(fn, **kw):
        seen.append(real(fn, **kw))
        return seen[-1]

    monkeypatch.setattr(decode, "measure", recording_measure)
    torch._dynamo.reset()
    _run({"kind": "decode", "name": "d", "seq_lens": [56], "batch_sizes": [1], "hidden": 32, "heads": 2,
          "decode_tokens": 4, "repeats": 2,
          "cases": [{"name": "ovq-compiled", "kind": "ovq", "chunk_size": 16, "max_centroids": 32,
                     "decode": "compiled"}, {"name": "full", "kind": "full"}]})
    assert [m.timed_graphs for m in seen] == [0, 0]


@pytest.mark.parametrize("method", ["ovq", "kvm"])
def test_routing_times_the_loop_and_static_router_and_compares_the_routes(monkeypatch, method):
    """The loop and the compiled static router route the same keys (a last chunk of 8 tokens: the router's
    sizes cover it); KVM's are ``LN(x)`` with gates ``1 + elu(x)``, drawn from seed 0."""
    import recurrences.kvm

    routed, real_route = [], recurrences.kvm.route_kvm
    monkeypatch.setattr(recurrences.kvm, "route_kvm", lambda *a, **kw: routed.append(a) or real_route(*a, **kw))
    keys = dict(max_centroids=8) if method == "ovq" else dict(budget="power_law", growth_factor=4.0,
                                                                max_state_chunks=0)
    rows = _run({"kind": "routing", "name": "r", "method": method, "seq_lens": [168], "heads": 2, "head_dim": 8,
                 "chunk_size": 16, "repeats": 1, **keys})
    assert [r["case"] for r in rows] == ["loop", "static compiled"]
    assert all(r["time_s"] > 0 and r["same_routes"] is True for r in rows)
    if method == "kvm":
        g = torch.Generator().manual_seed(0)
        kbar = torch.nn.functional.layer_norm(torch.randn(1, 2, 168, 8, generator=g), (8,))
        gate = 1 + torch.nn.functional.elu(torch.randn(1, 2, 168, generator=g))
        assert routed and all(torch.equal(a[0], kbar) and torch.equal(a[1], gate) for a in routed)


def test_routing_reports_a_router_whose_routes_differ_from_the_loops(monkeypatch):
    from ovqflex.bench.scenarios import recurrent

    def wrong(kbar, gate, weight, bias):
        return torch.zeros(kbar.shape[:-1], dtype=torch.long), torch.zeros(kbar.shape[:-1], dtype=torch.long)

    monkeypatch.setattr(recurrent, "_static_routers", lambda make, dev, module: {"static compiled": wrong})
    rows = _run({"kind": "routing", "name": "r", "method": "kvm", "seq_lens": [64], "heads": 2, "head_dim": 8,
                 "chunk_size": 16, "repeats": 1})
    assert [(r["case"], r["same_routes"]) for r in rows] == [("loop", True), ("static compiled", False)]


@pytest.mark.parametrize("method", ["ovq", "kvm"])
def test_routing_on_cuda_adds_the_graph_with_the_opaque_absorb_as_a_baseline(monkeypatch, method):
    """On CUDA, where a compiled step fuses its absorb (``FUSED_ABSORB``), the routing bench also makes
    a CUDA-graph router with the opaque absorb, the flag off while it is made (its step compiles and
    is captured then) and restored after. The routers are stand-ins here (no GPU)."""
    import importlib

    from ovqflex.bench.scenarios.recurrent import _static_routers

    module = importlib.import_module(f"recurrences.{method}.routing_static")
    monkeypatch.setitem(module.FUSED_ABSORB, "cuda", True)
    made = []
    routers = _static_routers(lambda cuda_graph: made.append((cuda_graph, module.FUSED_ABSORB["cuda"])) or len(made),
                              torch.device("cuda"), module)
    assert routers == {"static compiled": 1, "static cuda graph": 2, "static cuda graph, opaque absorb": 3}
    assert made == [(False, True), (True, True), (True, False)] and module.FUSED_ABSORB["cuda"] is True
    monkeypatch.setitem(module.FUSED_ABSORB, "cuda", False)  # nothing fused: no second graph
    assert list(_static_routers(lambda cuda_graph: 0, torch.device("cuda"), module)) == ["static compiled",
                                                                                        "static cuda graph"]


def test_recurrent_times_the_other_chunk_form_against_the_default():
    """On a CPU the default runs the chunks in a loop; ``other_chunk_form`` adds the blocked scan, whose
    ``x_vs_reference`` is its speed-up over the default; ``ovq = false`` leaves the OVQ baseline out."""
    rows = _run({"kind": "recurrent", "name": "r", "seq_lens": [160], "heads": 2, "head_dim": 8, "chunk_size": 4,
                 "vla_chunk": 4, "ovq": False, "max_reference_len": 0, "other_chunk_form": True, "repeats": 1})
    by_case = {r["case"]: r for r in rows}
    assert set(by_case) == {f"{name} chunked {what}" for name in
                            ("linear", "deltanet", "vla", "deltanet blocked", "vla blocked")
                            for what in ("fwd", "fwd+bwd")} | {"sdpa causal fwd"}
    for name in ("deltanet", "vla"):
        for what in ("fwd", "fwd+bwd"):
            other, default = by_case[f"{name} blocked chunked {what}"], by_case[f"{name} chunked {what}"]
            assert other["x_vs_reference"] == pytest.approx(default["time_s"] / other["time_s"])


def test_recurrent_checks_each_chunked_forward_against_its_reference_loop(monkeypatch):
    """Up to ``max_reference_len`` the loops run: each chunked forward (either form) is timed against its
    default form's, and its last output compared with its loop's (``rel_err_vs_reference``); the OVQ
    baseline runs on ``ovq_backend`` (beta sqrt(head_dim)) next to causal SDPA. The ops see the seeded
    draws; a forward runs without gradients, a forward+backward with every input a leaf that wants one."""
    import recurrences.delta
    import recurrences.vla
    from ovqflex.ops import linear, ovq

    calls = []

    def spying(module, fn_name):
        real = getattr(module, fn_name)

        def spy(*args, **kwargs):
            wants = tuple(a.requires_grad for a in args if isinstance(a, torch.Tensor))
            calls.append((fn_name, torch.is_grad_enabled(), wants, args, kwargs))
            return real(*args, **kwargs)
        monkeypatch.setattr(module, fn_name, spy)

    for module, fn_name in [(linear, "linear_attention"), (linear, "delta_rule"), (linear, "vla_attention"),
                            (recurrences.delta, "delta_rule_chunked"), (recurrences.vla, "vla_chunked"),
                            (ovq, "ovq_attention"), (torch.nn.functional, "scaled_dot_product_attention")]:
        spying(module, fn_name)
    rows = _run({"kind": "recurrent", "name": "r", "seq_lens": [40], "heads": 2, "head_dim": 8, "chunk_size": 4,
                 "vla_chunk": 4, "max_centroids": 8, "ovq_chunk": 16, "max_reference_len": 40,
                 "other_chunk_form": True, "repeats": 1})
    by_case = {r["case"]: r for r in rows}
    assert "error" not in str(rows)
    ops = ("linear", "deltanet", "vla")
    assert set(by_case) == {f"{name} chunked {what}" for name in ops + ("deltanet blocked", "vla blocked")
                            for what in ("fwd", "fwd+bwd")} | {f"{name} reference loop fwd" for name in ops} | {
        "ovq blocked fwd", "sdpa causal fwd"}
    for name in ops:
        fwd, loop = by_case[f"{name} chunked fwd"], by_case[f"{name} reference loop fwd"]
        assert fwd["x_vs_reference"] == pytest.approx(loop["time_s"] / fwd["time_s"])
    for form in ops + ("deltanet blocked", "vla blocked"):
        assert by_case[f"{form} chunked fwd"]["rel_err_vs_reference"] < 1e-5, form
        assert "rel_err_vs_reference" not in by_case[f"{form} chunked fwd+bwd"]
    assert all("rel_err_vs_reference" not in by_case[c] for c in ("ovq blocked fwd", "sdpa causal fwd"))

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 8, generator=g)
    by_fn = {}
    for fn_name, grad, wants, args, kwargs in calls:
        by_fn.setdefault(fn_name, []).append((grad, wants, kwargs))
        assert wants == ((True,) * len(wants) if grad else (False,) * len(wants)), (fn_name, grad, wants)
        if fn_name != "vla_chunked":  # (VLA's chunks see k and u unit-normalised)
            assert torch.equal(args[0].detach(), q), fn_name
    assert {fn_name: {grad for grad, _, _ in seen} for fn_name, seen in by_fn.items()} == {
        "linear_attention": {False, True}, "delta_rule": {False, True}, "vla_attention": {False, True},
        "delta_rule_chunked": {False, True}, "vla_chunked": {False, True}, "ovq_attention": {False},
        "scaled_dot_product_attention": {False}}
    assert {kw["blocked"] for _, _, kw in by_fn["delta_rule_chunked"] + by_fn["vla_chunked"]} == {True}  # CPU: loop
    assert all(kw["backend"] == "blocked" for _, _, kw in by_fn["ovq_attention"])
    assert all(kw["is_causal"] for _, _, kw in by_fn["scaled_dot_product_attention"])
    assert all(torch.equal(args[3], torch.full((2,), 8**0.5)) for fn_name, *_, args, _ in calls
               if fn_name == "ovq_attention")


def test_generate_times_prefill_and_new_tokens_and_compares_the_tokens(capsys):
    """... and leaves the CUDA-graph decode out on the CPU, saying so."""
    rows = _run({"kind": "generate", "name": "g", "preset": "tiny", "vocab_size": 64, "prompt_lens": [40],
                 "batch_sizes": [1, 2], "new_tokens": 3, "decodes": ["functional", "graph", "static"], "repeats": 1,
                 "model_options": {"backend": "dense"}})
    assert [(r["decode"], r["batch"], r["prompt"]) for r in rows] == [
        ("functional", 1, 40), ("functional", 2, 40), ("static", 1, 40), ("static", 2, 40)]
    assert "scenario 'g': decode 'graph' replays a CUDA graph, left out on cpu" in capsys.readouterr().out
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_s"] > 0
        assert r["new_tokens_per_s"] == pytest.approx(r["batch"] * 2 / r["decode_s"])
        ref = next(f for f in rows if f["decode"] == "functional" and f["batch"] == r["batch"])
        assert r["x_vs_functional"] == pytest.approx(r["new_tokens_per_s"] / ref["new_tokens_per_s"])
        assert r["same_tokens"] is True


def test_generate_reports_different_tokens(monkeypatch):
    """same_tokens compares the tokens, it does not assume them equal: a static path that
    answers other tokens is reported False (and without the functional run, None). The model generates in
    eval mode."""
    from ovqflex.models import HybridLM

    generate, training = HybridLM.generate, []

    def off_by_one(self, prompt, n, **kw):
        training.append(self.training)
        out = generate(self, prompt, n, **kw)
        return out if kw.get("decode") == "functional" else (out + 1) % self.config.vocab_size

    monkeypatch.setattr(HybridLM, "generate", off_by_one)
    table = {"kind": "generate", "name": "g", "preset": "tiny", "vocab_size": 64, "prompt_lens": [20],
             "new_tokens": 2, "decodes": ["functional", "static"], "repeats": 1, "model_options": {"backend": "dense"}}
    assert [r["same_tokens"] for r in _run(table)] == [True, False]
    assert [r["same_tokens"] for r in _run({**table, "decodes": ["static"]})] == [None]
    assert training and not any(training)


def test_model_scenarios_run_flex_unless_their_options_name_a_backend():
    table = {"kind": "generate", "name": "g", "preset": "tiny", "vocab_size": 64}
    assert parse_scenario(table, "test").config().backend == "flex"
    assert parse_scenario({**table, "model_options": {"backend": "dense"}}, "test").config().backend == "dense"


def test_timed_generate_times_each_call_from_the_end_of_its_prefill_to_its_return(monkeypatch):
    """On a clock the test moves (each forward 1 s; after the prefill, call ``i`` takes ``10 i`` s more):
    the median over the timed calls of the seconds from the end of the call's first forward (its prefill) to
    its return, the warm-up call untimed; the hook that reads the clock is removed after."""
    import time

    from ovqflex.bench.scenarios.generate import _timed_generate

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    class Fake(torch.nn.Module):
        calls = 0

        def forward(self, x):
            clock[0] += 1.0
            return x

        def generate(self, prompt, n, *, temperature, decode):
            assert (temperature, decode) == (0, "static")
            self.calls += 1
            self(prompt)  # the prefill
            clock[0] += 10.0 * self.calls
            for _ in range(n - 1):
                self(prompt)
            return prompt + self.calls

    model = Fake()
    out, seconds = _timed_generate(model, torch.zeros(1, 3), 3, "static", torch.device("cpu"), 3)
    monkeypatch.undo()
    # calls 2, 3, 4 (call 1 warms up): 10 i s and two decode forwards after the prefill -> 22, 32, 42 s
    assert seconds == 32.0 and torch.equal(out, torch.full((1, 3), 4.0)) and not model._forward_hooks


def test_quantized_compares_int8_with_fp32_on_the_same_prompt():
    """Rows fp32 then int8: the int8 model's prompt logits against the fp32 model's (within the stated 2e-2,
    not equal), tokens/s of ``decode_tokens`` new tokens and the ratio to fp32's."""
    rows = _run({"kind": "quantized", "name": "q", "preset": "tiny", "vocab_size": 64, "prompt_len": 32,
                 "decode_tokens": 3, "repeats": 1, "model_options": {"backend": "dense"}})
    assert [(r["case"], r["pattern"], r["prompt"]) for r in rows] == [("fp32", "swa,ovq", 32), ("int8", "swa,ovq", 32)]
    fp32, int8 = rows
    assert fp32["rel_err_logits"] == 0 and 0 < int8["rel_err_logits"] < 2e-2
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(3 / r["generate_s"])
        assert r["x_vs_fp32"] == pytest.approx(r["tokens_per_s"] / fp32["tokens_per_s"])


@pytest.mark.parametrize("broken", [False, True], ids=["whole", "graph-break"])
def test_train_reports_what_compiling_did_per_model(monkeypatch, broken, eager_backend_compile):
    """Each pattern's row carries the graphs its first step compiled, its graph breaks and its recompiles
    over all steps, and its tokens/s over the first pattern's (the baseline's)."""
    from ovqflex.models.hybrid import HybridLM

    if broken:
        forward = HybridLM.forward

        def broken_forward(self, *args, **kwargs):
            out = forward(self, *args, **kwargs)
            torch._dynamo.graph_break()
            return out

        monkeypatch.setattr(HybridLM, "forward", broken_forward)
    rows = _run({"kind": "train", "name": "t", "patterns": ["swa", "swa,ovq"], "seq_len": 64, "batch_size": 2,
                 "steps": 2, "warmup_steps": 1, "task_options": {"vocab_size": 64, "key_len": 1, "value_len": 1},
                 "model_options": {"d_model": 32, "n_heads": 2, "window": 16, "chunk_size": 16, "block_size": 16,
                                   "ovq.max_centroids": 8}})
    assert [r["pattern"] for r in rows] == ["swa", "swa,ovq"]
    for r in rows:
        assert r["graphs_first_step"] >= 1 and r["recompiles"] == 0 and r["tokens_per_s"] > 0
        assert (r["T"], r["batch"]) == (64, 2) and r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_s"])
        assert r["graph_breaks"] == (1 if broken else 0)
        assert r["x_vs_baseline"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert rows[0]["x_vs_baseline"] == 1.0


def test_train_steps_each_on_its_own_batch_with_the_scenarios_model_and_compiles_only_when_asked(monkeypatch):
    """``compile = false`` trains the model eagerly (no graph compiled); the warm-up and the timed steps each draw
    their own batch (steps 0, 1, 2, ...), each an optimizer step then a zeroing of the gradients; the row reports
    the size, in millions of parameters, of the model of the scenario's preset (``small``: 4 layers here)."""
    import ovqflex.tasks as tasks
    import ovqflex.training.setup as setup

    batches, calls = [], []
    make_batch, build_optimizer = tasks.make_batch, setup.build_optimizer
    monkeypatch.setattr(tasks, "make_batch", lambda task, **kw: batches.append(kw["step"]) or make_batch(task, **kw))

    def recording_optimizer(model, cfg):
        opt = build_optimizer(model, cfg)
        step, zero_grad = opt.step, opt.zero_grad
        opt.step = lambda *a, **kw: calls.append("step") or step(*a, **kw)
        opt.zero_grad = lambda *a, **kw: calls.append("zero_grad") or zero_grad(*a, **kw)
        return opt

    monkeypatch.setattr(setup, "build_optimizer", recording_optimizer)
    table = {"kind": "train", "name": "t", "patterns": ["swa"], "seq_len": 64, "batch_size": 2, "steps": 2,
             "warmup_steps": 2, "preset": "small", "compile": False,
             "task_options": {"vocab_size": 64, "key_len": 1, "value_len": 1},
             "model_options": {"d_model": 32, "n_heads": 2, "window": 16, "chunk_size": 16, "block_size": 16}}
    (row,) = _run(table)
    assert batches[:4] == [0, 1, 2, 3] and calls == ["step", "zero_grad"] * len(batches)
    assert row["graphs_first_step"] == 0 and row["graph_breaks"] == row["recompiles"] == 0
    cfg = parse_scenario(table, "test").train_config("swa")
    model = setup.build_model(cfg, setup.build_task(cfg))
    assert cfg.preset == "small" and len(model.blocks) == 4
    assert row["params_m"] == model.num_parameters() / 1e6


def test_blockmask_reports_the_visible_blocks_of_its_state_bank_program(monkeypatch):
    """256 tokens, chunks of 32, banks of 20 rows (chunk ``c`` reads ``min(32 c * 20 // (32 c + 20), 20)`` of
    them), 64-blocks: 8 banks of 20 rows, 160 state rows padded to 192 (whole blocks), 448 kv rows. Its visible
    blocks are counted here from the regions' cell definitions on a dense grid; ``with_q_side`` builds the
    backward's lists too."""
    import ovqflex.bench.scenarios.program as program_kind
    from masks.regions import Geometry, OwnChunk, StateBank

    asked, build = [], program_kind.build_block_layout

    def recording(*args, **kwargs):
        layout = build(*args, **kwargs)
        block_mask = layout.block_mask
        layout.block_mask = lambda *a, **kw: asked.append(kw.get("with_q_side")) or block_mask(*a, **kw)
        return layout

    monkeypatch.setattr(program_kind, "build_block_layout", recording)
    (row,) = _run({"kind": "blockmask", "name": "b", "seq_len": 256, "chunk_size": 32, "state_rows": 20,
                   "block_size": 64, "with_q_side": True, "repeats": 1})
    assert asked and all(asked)
    c = torch.arange(8)
    live = torch.clamp(c * 32 * 20 // (c * 32 + 20), max=20)
    geom = Geometry(256, 256, 192, 256, 64, 64)
    regions = (StateBank(20, 32, live), OwnChunk(32))
    q, kv = torch.arange(256)[:, None], torch.arange(448)[None, :]
    seen = torch.zeros(256, 448, dtype=torch.bool)
    for r in regions:
        seen |= r.contains(r.params(geom, torch.device("cpu")), q, kv)
    visible = int(seen.view(4, 64, 7, 64).any(3).any(1).sum())
    assert (row["T"], row["kv_rows"], row["q_side"], row["visible_blocks"]) == (256, 448, True, visible)
    assert row["block_sparsity"] == pytest.approx(1 - visible / (4 * 7))
    assert row["dense_mask_would_be_gb"] == 256 * 448 / 2**30


def test_viz_times_the_program_and_the_views_of_the_layer_asked_for(monkeypatch):
    import ovqflex.viz as viz

    calls, method_program = [], viz.method_program
    monkeypatch.setattr(viz, "method_program", lambda *a: calls.append(a) or method_program(*a))
    options = {"chunk_size": 32, "max_centroids": 16, "block_size": 32}
    rows = _run({"kind": "viz", "name": "v", "method": "ovq", "seq_lens": [64], "heads": 2, "head_dim": 8,
                 "options": options, "views": ["token", "block"]})
    assert calls and all(call == ("ovq", viz.VizShape(seq_len=64, heads=2, head_dim=8), options) for call in calls)
    g = method_program("ovq", viz.VizShape(seq_len=64, heads=2, head_dim=8), options)[0].geom
    assert [r["case"] for r in rows] == ["program (op, random input)", "token+block view + PNG"]
    assert all((r["T"], r["kv_rows"], r["blocks"]) == (64, g.kv_len, f"{g.n_q_blocks}x{g.n_kv_blocks}") for r in rows)
    with pytest.raises(ValueError, match="views must be a non-empty subset"):
        parse_scenario({"kind": "viz", "method": "ovq", "seq_lens": [64], "views": ["pixels"]}, "test")
