"""Aggregation of evaluation reports over seeds (mean, min, max), the table, JSON and plot,
from synthetic ``eval-<variant>.json`` files."""
import json
import re
import sys

import pytest

from ovqflex.experiments import EvalSweep, Experiment, ModelSpec, Scale, collect, plan, table, write_results

SCALE = Scale(preset="tiny", seq_len=64, steps=10, batch_size=2, eval_lengths=(64, 128, 256), eval_examples=4,
              task_options=dict(vocab_size=256, key_len=2, value_len=1))
EXP = Experiment("t", "test", "icr", (ModelSpec("a", "swa,ovq"), ModelSpec("b", "swa,linear")), {"s": SCALE},
                 sweeps=(EvalSweep("max_centroids", (1, 2), ("a",), symbol="N"),))


def fake_eval(p, label, seed, variant, accs, *, lengths=None, step=None, examples=4, overrides=None):
    run = next(r for r in p.runs if r.model.label == label and r.seed == seed)
    v = next(v for v in run.variants if v.name == variant)
    run.dir.mkdir(parents=True, exist_ok=True)
    rows = [{"length": n, "accuracy": a, "loss": 1.0, "targets": 24, "examples": examples, "seconds": 0.1}
            for n, a in zip(lengths or p.lengths, accs)]
    doc = {"task": "icr", "step": step or run.train.steps, "overrides": p.eval_overrides(v) if overrides is None
           else overrides, "rows": rows}
    (run.dir / f"eval-{variant}.json").write_text(json.dumps(doc))


def test_mean_min_max_over_seeds(tmp_path):
    p = plan(EXP, "s", tmp_path, seeds=[0, 1])
    fake_eval(p, "a", 0, "base", [1.0, 0.5, 0.25])
    fake_eval(p, "a", 1, "base", [0.5, 0.5, 0.75])
    fake_eval(p, "a", 0, "max_centroids-x2", [1.0, 0.75, 0.5])
    fake_eval(p, "a", 1, "max_centroids-x2", [0.9, 0.9, 0.9], lengths=[64, 128, 512])  # other lengths: ignored
    fake_eval(p, "b", 0, "base", [0.2, 0.1, 0.0], step=5)                                # not the final step: ignored
    fake_eval(p, "b", 1, "base", [0.4, 0.2, 0.1])
    res = collect(p)
    lines = {line["label"]: line for line in res["lines"]}
    assert list(lines) == ["a", "a N×2", "b"]
    a = lines["a"]["points"]
    assert [pt["mean"] for pt in a] == [0.75, 0.5, 0.5]
    assert [(pt["min"], pt["max"], pt["n"]) for pt in a] == [(0.5, 1.0, 2), (0.5, 0.5, 2), (0.25, 0.75, 2)]
    assert a[0]["seeds"] == {"0": 1.0, "1": 0.5}
    assert lines["a N×2"]["seeds"] == 1 and [pt["mean"] for pt in lines["a N×2"]["points"]] == [1.0, 0.75, 0.5]
    assert lines["a N×2"]["overrides"] == {"max_centroids": 4096}
    assert lines["b"]["seeds"] == 1 and lines["b"]["points"][0]["seeds"] == {"1": 0.4}
    text = table(res)
    assert "0.750 (0.50–1.00)" in text and "2/2" in text and "1/2" in text
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", row) for row in text.splitlines()[2:])}
    assert rows["a"] == ["2/2", "0.750 (0.50–1.00)", "0.500", "0.500 (0.25–0.75)"]  # seeds that agree: no range
    assert text.splitlines()[0].split() == ["model", "seeds", "64", "128", "256"]


def test_reports_not_evaluated_as_planned_are_ignored(tmp_path):
    """A report counts only with the planned lengths, examples per length and overrides, and only
    when it is whole JSON."""
    p = plan(EXP, "s", tmp_path, seeds=[0, 1, 2])
    fake_eval(p, "a", 0, "base", [1.0, 1.0, 1.0])
    fake_eval(p, "a", 1, "base", [0.0, 0.0, 0.0], examples=2)
    fake_eval(p, "a", 2, "base", [0.0, 0.0, 0.0], overrides={"max_centroids": 512})
    fake_eval(p, "a", 0, "max_centroids-x2", [0.0, 0.0], lengths=[64, 128])  # a length short: ignored
    fake_eval(p, "a", 1, "max_centroids-x2", [1.0, 1.0, 1.0])
    (p.runs[4].dir / "eval-max_centroids-x2.json").write_text('{"rows": [')  # cut by a crash: ignored
    assert p.runs[4].model.label == "a" and p.runs[4].seed == 2
    line = collect(p)["lines"][0]
    assert line["label"] == "a" and line["seeds"] == 1 and line["points"][0]["seeds"] == {"0": 1.0}
    swept = collect(p)["lines"][1]
    assert swept["label"] == "a N×2" and swept["seeds"] == 1 and swept["points"][-1]["seeds"] == {"1": 1.0}


def test_missing_reports_leave_empty_cells(tmp_path):
    p = plan(EXP, "s", tmp_path, seeds=[0])
    fake_eval(p, "a", 0, "base", [1.0, 1.0, 1.0])
    res = collect(p)
    assert res["lines"][2]["points"][0] == {"length": 64, "mean": None, "min": None, "max": None, "n": 0, "seeds": {}}
    row_b = [line for line in table(res).splitlines() if line.startswith("b ")][0]
    assert row_b.split() == ["b", "0/1", "-", "-", "-"]


def test_write_results_files(tmp_path):
    p = plan(EXP, "s", tmp_path, seeds=[0, 1])
    for seed, acc in ((0, 0.5), (1, 1.0)):
        for label, variant in (("a", "base"), ("a", "max_centroids-x2"), ("b", "base")):
            fake_eval(p, label, seed, variant, [acc, acc / 2, acc / 4])
    res = write_results(p)
    assert json.loads((tmp_path / "results.json").read_text()) == {k: v for k, v in res.items()
                                                                   if k not in ("table", "files")}
    md = (tmp_path / "results.md").read_text()
    assert "| model " in md and "| a N×2 " in md and "0.750 (0.50–1.00)" in md
    assert "trained at 64 tokens, 10 steps of 2 sequences." in md
    png = tmp_path / "results.png"
    assert res["files"][-1] == str(png) and png.stat().st_size > 5000
    assert res["train_seq_len"] == 64 and res["lengths"] == [64, 128, 256]
    assert [pt["mean"] for pt in res["lines"][0]["points"]] == pytest.approx([0.75, 0.375, 0.1875])


def test_runs_that_diverged_are_counted_by_seed(tmp_path, monkeypatch):
    """b's seed 1 diverged after step 7, a's after step 9 (their run directories' records, as the trainer
    writes them), and have no report: each line counts its model's seed as diverged; a line whose every run
    diverged keeps its table row and its legend entry; a line with neither points nor divergence has none."""
    from matplotlib.figure import Figure

    p = plan(EXP, "s", tmp_path, seeds=[0, 1])
    fake_eval(p, "a", 0, "base", [1.0, 0.5, 0.25])
    fake_eval(p, "b", 0, "base", [0.4, 0.2, 0.1])
    for label, seed, step in (("b", 1, 7), ("a", 0, None), ("a", 1, 9)):
        run = next(r for r in p.runs if r.model.label == label and r.seed == seed)
        run.dir.mkdir(parents=True, exist_ok=True)
        if step is not None:
            (run.dir / "diverged.json").write_text(json.dumps({"step": step, "message": "training diverged: ..."}))
    legends = []
    real_savefig = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()])
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    res = write_results(p)
    lines = {line["label"]: line for line in res["lines"]}
    assert lines["b"]["diverged"] == {"1": 7} and lines["b"]["seeds"] == 1
    assert lines["a"]["diverged"] == {"1": 9} and lines["a N×2"]["diverged"] == {"1": 9}
    seeds = {cells[0]: cells[1] for cells in (re.split(r"\s{2,}", row) for row in res["table"].splitlines()[2:])}
    assert seeds == {"a": "1/2, 1 diverged", "a N×2": "0/2, 1 diverged", "b": "1/2, 1 diverged"}
    assert (tmp_path / "results.png").stat().st_size > 5000
    assert legends == [["a (1 seed, 1 diverged)", "a N×2 (0 seeds, 1 diverged)", "b (1 seed, 1 diverged)",
                        "train length 64"]]
    (p.runs[3].dir / "diverged.json").unlink()  # b seed 1 did not diverge after all; a's line N×2 still did
    (p.runs[2].dir / "diverged.json").unlink()  # nor a's: its N×2 line has no points and nothing to say
    write_results(p)
    assert legends[1] == ["a (1 seed)", "b (1 seed)", "train length 64"]


def test_without_matplotlib_the_results_are_written_without_a_plot(tmp_path, monkeypatch):
    p = plan(EXP, "s", tmp_path, seeds=[0])
    fake_eval(p, "a", 0, "base", [1.0, 0.5, 0.25])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" raises ImportError
    res = write_results(p)
    assert res["files"] == [str(tmp_path / "results.json"), str(tmp_path / "results.md")]
    assert not (tmp_path / "results.png").exists() and "0.500" in res["table"]


def test_a_length_warm_up_is_recorded_and_said(tmp_path):
    scale = Scale(preset="tiny", seq_len=128, steps=10, batch_size=2, eval_lengths=(128, 256), eval_examples=4,
                  task_options=dict(vocab_size=256, key_len=2, value_len=1),
                  train_options={"length_warmup": (64,), "length_warmup_steps": 4})
    p = plan(Experiment("w", "test", "icr", (ModelSpec("a", "swa,ovq"),), {"s": scale}), "s", tmp_path, seeds=[0])
    res = write_results(p)
    assert res["train_length_warmup"] == [64] and res["train_length_warmup_steps"] == 4
    assert "trained at 128 tokens (first 64 tokens over 4 steps), 10 steps of 2 sequences." in (
        tmp_path / "results.md").read_text()
