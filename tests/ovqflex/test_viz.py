"""The viz method registry: every registered layer yields its program; the CLI draws it."""
import re

import pytest
import torch

from masks.viz import program_stats
from ovqflex.cli import main
from ovqflex.viz import VizConfig, VizShape, drawable_methods, method_program

SMALL = dict(chunk_size=32, block_size=32)
# layer options keeping each program small; a new method adds one entry (or none: defaults)
OPTIONS = {"ovq": dict(SMALL, max_centroids=32), "kvm": dict(SMALL, growth_factor=4.0), "full": dict(block_size=32), "swa": dict(window=16, block_size=32),
           "bswa": dict(SMALL, block_window=2), "sinks": dict(window=16, n_sinks=2, block_size=32)}
REGIONS = {"ovq": ["state", "window"], "kvm": ["state", "window"], "full": ["causal"], "swa": ["window"], "bswa": ["window"],
           "sinks": ["sink", "window"]}


@pytest.mark.parametrize("method", drawable_methods())
def test_every_method_builds_its_program(method):
    program, layer, temps = method_program(method, VizShape(seq_len=96, heads=2, head_dim=8), OPTIONS.get(method))
    assert program.q_len == 96 and tuple(program.q.shape[:2]) == (1, 2)
    if method in REGIONS:
        assert [r.name for r in program.regions] == REGIONS[method]
    s = program_stats(program)
    assert 1 <= s.keys_per_query_min <= s.keys_per_query_max


def test_ovq_temperature_is_beta():
    _, layer, temps = method_program("ovq", VizShape(seq_len=64, heads=2, head_dim=16), OPTIONS["ovq"])
    assert temps["state"].tolist() == pytest.approx([4.0, 4.0])  # beta init sqrt(head_dim)


def test_kvm_temperatures_are_the_region_taus():
    _, layer, temps = method_program("kvm", VizShape(seq_len=96, heads=2, head_dim=16), OPTIONS["kvm"])
    assert temps["state"].tolist() == [1.0, 1.0] and temps["window"].tolist() == [1.0, 1.0]  # init 1


def test_the_seed_draws_the_layer_and_the_input():
    """``seed`` seeds the layer's init and the input ``x ~ N(0, 1)`` (``VizShape``): the program is the layer's on
    that input; another seed, another layer and input; a negative seed is refused."""
    shape = VizShape(seq_len=64, batch=2, heads=2, head_dim=8, seed=3)
    program, layer, _ = method_program("nope", shape, {"block_size": 32})
    again, same_layer, _ = method_program("nope", shape, {"block_size": 32})
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(program.q, layer.program(x).q) and torch.equal(again.k, program.k)
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), same_layer.parameters()))
    _, other, _ = method_program("nope", VizShape(seq_len=64, batch=2, heads=2, head_dim=8, seed=4), {"block_size": 32})
    assert not torch.equal(other.qkv_proj.weight, layer.qkv_proj.weight)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        VizShape(seed=-1)


def test_the_render_options_are_the_commands():
    """What ``ovqflex viz`` is told reaches the renderer: the drawn batch row and head, queries, sizes, colours,
    the layer's temperatures; the statistic's chunk is ``--chunk``, else the layer's chunk size, else the block
    size (None); the page's metadata names the options given."""
    cfg = VizConfig(method="ovq", seq_len=64, batch=2, heads=2, head_dim=8, batch_index=1, head=1, queries=(3, 9),
                    options={"chunk_size": 32, "max_centroids": 16}, max_token_cells=500, term_width=70,
                    term_height=20, color=True)
    _, layer, temps = method_program(cfg.method, cfg, cfg.options)
    opts = cfg.render_options(layer, temps)
    assert (opts.batch, opts.head, opts.queries, opts.chunk, opts.max_token_cells, opts.term_width, opts.term_height,
            opts.color) == (1, 1, (3, 9), 32, 500, 70, 20, True)
    assert opts.temperatures is temps and opts.title == "ovq, T=64"
    assert opts.meta["options"] == {"chunk_size": 32, "max_centroids": 16} and opts.meta["drawn batch, head"] == "1, 1"
    assert VizConfig(method="ovq", chunk=8).render_options(layer, temps).chunk == 8
    _, causal, _ = method_program("nope", VizShape(seq_len=32), {"block_size": 32})
    plain = VizConfig(method="nope").render_options(causal, {})
    assert plain.chunk is None and plain.meta["options"] == "defaults"


@pytest.mark.parametrize("method, options, match", [("kvm2", {}, "method must be one of"),
                                                     ("full", {"window": 8}, "bad option for method 'full'")],
                         ids=["method", "option"])
def test_bad_method_or_option(method, options, match):
    with pytest.raises(ValueError, match=match):
        method_program(method, VizShape(seq_len=32), options)


def test_cli_viz_writes_every_format(tmp_path, capsys):
    """Every format and view written and named; a table per ``--query``, of the ``--head`` drawn (OVQ's heads
    route differently: head 0's tables are others)."""
    argv = ["viz", "ovq", "--seq-len", "128", "--heads", "2", "--head-dim", "8", "--opt", "chunk_size=32",
            "--opt", "max_centroids=32", "--opt", "block_size=32", "--query", "70", "--query", "100", "--head", "1",
            "--format", "png,svg,html,term", "--view", "token,block", "--width", "80", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "query 70:" in out and "query 100:" in out and "visible keys per query" in out and "#=state" in out
    assert re.search(r"\nblock view: \(4, 7\) blocks; program built in \d+\.\d\d s, views rendered in \d+\.\d\d s\n",
                     out)  # 4 query blocks of 32; 7 kv blocks: 128 tokens and 96 state rows
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["ovq-T128-block.png", "ovq-T128-block.svg", "ovq-T128-stats.json", "ovq-T128-token.png",
                       "ovq-T128-token.svg", "ovq-T128.html"]
    assert all(f"wrote {tmp_path / name}\n" in out for name in written)
    tables = out[out.index("query 70:"):out.index("\nwrote ")]
    assert re.search(r" 0\.000 ", tables), tables  # the token rows' bias, as inspect_query formats it (3 decimals)
    assert main(argv[:argv.index("--head")] + ["--head", "0", "--format", "term", "--view", "token", "--width", "80",
                                               "--out", str(tmp_path / "head0")]) == 0
    head0 = capsys.readouterr().out
    assert tables != head0[head0.index("query 70:"):head0.index("\nwrote ")]


@pytest.mark.parametrize("argv, match", [(["viz", "kvm2"], "method must be one of"),
                                         (["viz", "swa", "--opt", "windw=3"], "bad option for method 'swa'"),
                                         (["viz", "swa", "--seq-len", "0"], "seq_len must be >= 1"),
                                         (["viz", "swa", "--seq-len", "64", "--query", "64"],
                                          "--query must be < --seq-len (64), got 64"),
                                         (["viz", "swa", "--heads", "2", "--head", "2"], "--head must be < --heads (2), got 2"),
                                         (["viz", "swa", "--batch-index", "1"], "--batch-index must be < --batch (1), got 1"),
                                         (["viz", "swa", "--max-cells", "0"], "--max-cells must be >= 1, got 0"),
                                         (["viz", "swa", "--height", "0"], "--height must be >= 1, got 0"),
                                         (["viz", "ovq", "--seq-len", "64", "--chunk", "0"], "--chunk must be >= 1, got 0")],
                         ids=["method", "option", "seq-len", "query", "head", "batch-index", "max-cells", "height-zero",
                              "chunk-zero"])
def test_cli_viz_bad_arguments(tmp_path, capsys, argv, match):
    """Errors name the flag to change (they had named the renderer's fields: ``batch must be < B=1`` for
    ``--batch-index``, ``max_token_cells`` for ``--max-cells``; ``--height 0`` was a ZeroDivisionError),
    before the layer is built."""
    assert main([*argv, "--out", str(tmp_path), "--format", "term"]) == 2
    assert match in capsys.readouterr().err
