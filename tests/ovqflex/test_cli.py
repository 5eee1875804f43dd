"""The command line: bench on a small profile, clear errors on bad input, the flags of train, profile,
viz and demo derived from their config dataclasses (every field kind add_config_flags knows), one
--device default, config errors (and only those) as exit 2. That the flags the README and docs/ show
exist is tests/test_docs.py's."""
import argparse
import dataclasses
import json
import re
import sys
import types

import pytest
import torch

from ovqflex.cli import build_parser, main, tools
from ovqflex.cli.tools import DemoConfig
from ovqflex.cli.flags import add_config_flags, config_from_args
from ovqflex.devices import NAMES
from ovqflex.profiling import ProfileConfig
from ovqflex.training import TrainConfig
from ovqflex.viz import VizConfig
from recurrences.checks import ConfigTypeError


def test_bench_runs_a_profile_and_writes_json(tmp_path, capsys):
    prof = tmp_path / "tiny.toml"
    prof.write_text('name = "tiny"\n[[scenario]]\nkind = "blockmask"\nseq_len = 1024\nchunk_size = 128\nstate_rows = 256\n')
    assert main(["bench", str(prof), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "visible_blocks" in out and "tiny" in out
    rows = json.loads((tmp_path / "out" / "tiny.json").read_text())["rows"]
    # 8 query blocks; chunk c sees its bank (live rows grow with c) and its own block
    assert rows[0]["T"] == 1024 and rows[0]["visible_blocks"] > 8


def test_bench_only_matching_no_scenario_is_refused_and_keeps_the_last_json(tmp_path, capsys):
    prof = tmp_path / "tiny.toml"
    prof.write_text('name = "tiny"\n[[scenario]]\nname = "mask"\nkind = "blockmask"\nseq_len = 256\n'
                    'chunk_size = 128\nstate_rows = 128\n')
    out = tmp_path / "out"
    assert main(["bench", str(prof), "--out", str(out), "--only", "mask"]) == 0
    written = (out / "tiny.json").read_text()
    capsys.readouterr()
    assert main(["bench", str(prof), "--out", str(out), "--only", "mkas"]) == 2
    err = capsys.readouterr().err
    assert "only (--only) 'mkas' is in no scenario name of profile 'tiny'; its scenarios: mask" in err
    assert (out / "tiny.json").read_text() == written  # the earlier run's rows, not an empty table


def test_bench_shows_progress_and_keeps_the_scenarios_before_a_failure(tmp_path, capsys, monkeypatch):
    """A line per scenario on stderr; the rows of the scenarios that finished are in the JSON
    (``meta.partial``) when a later one stops the run."""
    from ovqflex.bench.runner import run_profile
    from ovqflex.bench.scenarios import KINDS

    schema, blockmask = KINDS["blockmask"]

    def second_fails(sc, device):
        if sc.name == "b":
            raise RuntimeError("cut short")
        return blockmask(sc, device)

    monkeypatch.setitem(KINDS, "blockmask", (schema, second_fails))
    table = 'kind = "blockmask"\nseq_len = 512\nchunk_size = 128\nstate_rows = 128\n'
    prof = tmp_path / "two.toml"
    prof.write_text(f'name = "two"\n[[scenario]]\nname = "a"\n{table}[[scenario]]\nname = "b"\n{table}')
    with pytest.raises(RuntimeError, match="cut short"):
        run_profile(prof, device="cpu", out_dir=tmp_path / "out")
    err = capsys.readouterr().err
    assert "scenario a (1 of 2)" in err and "scenario b (2 of 2)" in err
    saved = json.loads((tmp_path / "out" / "two.json").read_text())
    assert saved["meta"]["partial"] is True and {r["scenario"] for r in saved["rows"]} == {"a"}


def test_bench_records_whether_its_compile_caches_were_fresh(tmp_path):
    """``--fresh-compile-cache``: the JSON's ``meta.compile_cache`` says so (else "as found"); the meta of a
    complete run names the profile and the device and is not marked partial."""
    prof = tmp_path / "one.toml"
    prof.write_text('name = "one"\n[[scenario]]\nkind = "blockmask"\nseq_len = 512\nchunk_size = 128\n'
                    'state_rows = 128\n')
    for flags, cache in (([], "as found"), (["--fresh-compile-cache"], "fresh")):
        assert main(["bench", str(prof), "--device", "cpu", "--out", str(tmp_path / "out"), *flags]) == 0
        meta = json.loads((tmp_path / "out" / "one.json").read_text())["meta"]
        assert meta["compile_cache"] == cache
        assert (meta["profile"], meta["device"], "partial" in meta) == ("one", "cpu", False)


def test_bench_seq_lens_replace_the_chosen_scenarios_lengths(tmp_path, capsys, monkeypatch):
    """``--seq-lens``: each chosen scenario runs those lengths in that order instead of its own, and
    the JSON's ``meta.seq_lens`` says so; a chosen scenario without a ``seq_lens`` list is refused by
    name (exit 2) before anything runs, and bad lengths are refused by the flag."""
    from ovqflex.bench.scenarios import KINDS

    seen = []
    for kind in ("viz", "blockmask"):
        schema, _ = KINDS[kind]
        monkeypatch.setitem(KINDS, kind, (schema, lambda sc, device: seen.append((sc.name, sc.seq_lens)) or
                                          [{"T": T} for T in sc.seq_lens]))
    prof = tmp_path / "lens.toml"
    prof.write_text('name = "lens"\n'
                    '[[scenario]]\nname = "viz-a"\nkind = "viz"\nmethod = "swa"\nseq_lens = [64, 128, 256]\n'
                    '[[scenario]]\nname = "viz-b"\nkind = "viz"\nmethod = "ovq"\nseq_lens = [512]\n'
                    '[[scenario]]\nname = "mask"\nkind = "blockmask"\nseq_len = 512\nchunk_size = 128\n'
                    'state_rows = 128\n')
    out = tmp_path / "out"
    assert main(["bench", str(prof), "--device", "cpu", "--out", str(out), "--only", "viz", "--seq-lens",
                 "2048,1024"]) == 0
    assert seen == [("viz-a", [2048, 1024]), ("viz-b", [2048, 1024])]
    saved = json.loads((out / "lens.json").read_text())
    assert saved["meta"]["seq_lens"] == [2048, 1024] and [r["T"] for r in saved["rows"]] == [2048, 1024] * 2
    assert main(["bench", str(prof), "--device", "cpu", "--out", str(out), "--only", "viz"]) == 0
    assert seen[2:] == [("viz-a", [64, 128, 256]), ("viz-b", [512])]
    assert "seq_lens" not in json.loads((out / "lens.json").read_text())["meta"]
    capsys.readouterr()
    assert main(["bench", str(prof), "--device", "cpu", "--out", str(out), "--seq-lens", "2048"]) == 2
    assert re.search("scenario 'mask' \\(kind 'blockmask'\\) has none", capsys.readouterr().err)
    assert len(seen) == 4  # nothing ran
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", str(prof), "--seq-lens", "64,x"])


def test_bench_picks_a_nameless_scenario_by_its_kind_and_refuses_bad_lengths(tmp_path, monkeypatch):
    """A scenario without a name is its kind's: ``--only`` matches it, its rows are named so; the lengths
    ``run_profile(seq_lens=...)`` is given are checked before anything runs (the flag's own parsing aside)."""
    from ovqflex.bench import run_profile
    from ovqflex.bench.scenarios import KINDS

    seen = []
    schema, _ = KINDS["viz"]
    monkeypatch.setitem(KINDS, "viz", (schema, lambda sc, device: seen.append(sc.seq_lens) or [{"T": 64}]))
    prof = tmp_path / "p.toml"
    prof.write_text('[[scenario]]\nkind = "viz"\nmethod = "swa"\nseq_lens = [64]\n')
    assert main(["bench", str(prof), "--device", "cpu", "--out", str(tmp_path / "o"), "--only", "vi"]) == 0
    rows = json.loads((tmp_path / "o" / "p.json").read_text())["rows"]
    assert seen == [[64]] and rows == [{"scenario": "viz", "T": 64}]
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be >= 1, got 0"):
        run_profile(prof, device="cpu", out_dir=tmp_path / "o", seq_lens=[64, 0])
    assert seen == [[64]]


@pytest.mark.parametrize("text, match", [("name = 'x'\n", "no \\[\\[scenario\\]\\]"),
                                         ("[[scenario]]\nkind = 'nope'\n", "kind must be one of"),
                                         ("name = 'x'\nscenario = []\n", "no \\[\\[scenario\\]\\]"),
                                         ("[[scenario\n", "not valid TOML")],
                         ids=["empty", "kind", "no-tables", "toml"])
def test_bench_bad_profile(tmp_path, capsys, text, match):
    prof = tmp_path / "bad.toml"
    prof.write_text(text)
    assert main(["bench", str(prof)]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_bench_missing_profile(tmp_path, capsys):
    assert main(["bench", "does/not/exist.toml"]) == 2
    assert "profile 'does/not/exist.toml' does not exist" in capsys.readouterr().err
    assert main(["bench", str(tmp_path)]) == 2
    assert f"profile {str(tmp_path)!r} is a directory, not a TOML file" in capsys.readouterr().err


def test_readme_flags_exist():
    parser = build_parser()
    for argv in (["info", "--device", "cpu"], ["demo", "--seq-len", "64", "--batch", "1", "--hidden", "32",
                                                 "--heads", "2", "--window", "8", "--sinks", "1"],
                 ["bench", "p.toml", "--device", "cpu", "--out", "d", "--only", "x"]):
        parser.parse_args(argv)


def test_readme_train_and_eval_flags_exist():
    parser = build_parser()
    parser.parse_args(["train", "--task", "icr", "--pattern", "swa,ovq", "--preset", "tiny", "--steps", "3",
                       "--seq-len", "64", "--batch-size", "2", "--out", "d", "--resume", "--data", "f.txt",
                       "--task-opt", "key_len=1", "--model-opt", "d_model=32", "--no-compile"])
    args = parser.parse_args(["eval", "d", "--lengths", "64,128", "--examples", "4", "--override",
                              "max_centroids=64", "--checkpoint", "c"])
    assert args.lengths == [64, 128]


def test_readme_experiment_flags_exist():
    args = build_parser().parse_args(["experiment", "icr", "--scale", "gpu", "--seeds", "0,1", "--out", "d",
                                      "--models", "sw-ovq,sw-nope", "--device", "cuda", "--resume", "--dry-run",
                                      "--no-progress"])
    assert (args.name, args.scale, args.seeds, args.models) == ("icr", "gpu", [0, 1], ["sw-ovq", "sw-nope"])
    assert args.resume and args.dry_run and args.no_progress


def test_readme_generate_flags_exist():
    parser = build_parser()
    args = parser.parse_args(["generate", "d", "--tokens", "3,0,5", "--max-new-tokens", "32", "--temperature", "0",
                              "--top-k", "4", "--seed", "1", "--quantize", "int8", "--override", "max_centroids=64",
                              "--checkpoint", "c", "--device", "cpu"])
    assert args.tokens == [3, 0, 5] and args.quantize == "int8"
    assert parser.parse_args(["generate", "d", "--prompt", "hi"]).prompt == "hi"


@pytest.mark.parametrize("argv, match", [
    (["train", "--task", "sudoku"], "task must be one of \\[.copy., .icl., .icr.*got .sudoku."),
    (["train", "--seq-len", "0"], "seq_len must be >= 1"),
    (["train", "--seq-len", "8"], "too short for task 'icr'"),
    (["train", "--task", "text"], "needs a data file: --data"),
    (["train", "--task", "text", "--data", "/no/such/file.txt"], "/no/such/file.txt"),
    (["train", "--pattern", "swa,kvm2"], "unknown mixer 'kvm2'"),
    (["train", "--task-opt", "keylen"], "--task-opt: override must look like NAME=VALUE"),
    (["train", "--task-opt", "colour=3"], "colour"),
    (["eval", "/no/such/run"], "does not exist"),
    (["train", "--preset", "huge", "--seq-len", "64"],
     "preset must be one of \\['paper-icr', 'small', 'tiny'\\], got 'huge'"),
    (["train", "--model-opt", "n_head=4"], "unknown key 'n_head' \\(did you mean 'n_heads'\\?\\)"),
], ids=["task", "seq-len", "too-short", "text-no-data", "text-missing", "pattern", "opt-form", "opt-name", "eval",
        "preset", "model-opt-name"])
def test_bad_train_and_eval_arguments(tmp_path, capsys, argv, match):
    if argv[0] == "train":
        argv = [*argv, "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    assert re.search(re.escape(match) if "/" in match else match, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # a refused run leaves no directory behind


def test_train_out_must_not_be_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["train", "--out", str(tmp_path / "file"), "--no-progress"]) == 2
    assert f"out='{tmp_path / 'file'}' is a file, not a run directory" in capsys.readouterr().err


@pytest.mark.parametrize("lengths, expected", [("64,abc", "comma-separated integers like 512,1024"),
                                               ("0,64", "positive integers like 512,1024")], ids=["text", "zero"])
def test_bad_lengths_are_an_argparse_error(capsys, lengths, expected):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "d", "--lengths", lengths])
    assert f"argument --lengths: expected {expected}, got '{lengths}'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, expected", [
    (["eval", "d", "--lengths", "64,,256"], "--lengths", "comma-separated integers like 512,1024"),
    (["generate", "d", "--tokens", "3,,17"], "--tokens", "comma-separated token ids like 3,0,17"),
    (["experiment", "icr", "--seeds", "0,"], "--seeds", "distinct comma-separated integers >= 0"),
    (["experiment", "icr", "--models", "sw-ovq,,sw-nope"], "--models", "comma-separated model labels"),
    (["viz", "ovq", "--format", "png,,svg"], "--format", "a comma-separated subset of"),
], ids=["lengths", "tokens", "seeds", "models", "formats"])
def test_an_empty_item_of_a_comma_list_is_refused(capsys, argv, flag, expected):
    """``3,,17`` had been read as ``3,17``: a value left out was skipped (a prompt lost a token)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert f"argument {flag}: expected {expected}" in capsys.readouterr().err


def test_readme_viz_and_profile_flags_exist():
    parser = build_parser()
    args = parser.parse_args(["viz", "ovq", "--seq-len", "64", "--heads", "2", "--head-dim", "8", "--opt",
                              "max_centroids=32", "--view", "token,block", "--format", "png,svg,html,term",
                              "--query", "3", "--query", "5", "--head", "1", "--width", "80", "--color", "--out", "d"])
    cfg = config_from_args(VizConfig, args)
    assert (cfg.method, cfg.seq_len, cfg.heads, cfg.head_dim, cfg.options) == ("ovq", 64, 2, 8, {"max_centroids": 32})
    assert cfg.views == ("token", "block") and cfg.formats == ("png", "svg", "html", "term")
    assert (cfg.queries, cfg.head, cfg.term_width, cfg.color, cfg.out) == ((3, 5), 1, 80, True, "d")
    args = parser.parse_args(["profile", "model", "--seq-len", "64", "--batch", "2", "--heads", "2", "--head-dim",
                              "8", "--opt", "backend=blocked", "--pattern", "swa,ovq", "--preset", "tiny", "--mode",
                              "fwd,fwd+bwd", "--steps", "1", "--warmup", "0", "--trace", "t.json"])
    assert config_from_args(ProfileConfig, args) == ProfileConfig(
        target="model", seq_len=64, batch=2, heads=2, head_dim=8, options={"backend": "blocked"}, pattern="swa,ovq",
        preset="tiny", modes=("fwd", "fwd+bwd"), steps=1, warmup=0)
    assert args.trace == "t.json"


@pytest.mark.parametrize("argv, flag", [(["viz", "ovq", "--view", "pixels"], "--view"),
                                        (["viz", "ovq", "--format", "gif"], "--format"),
                                        (["viz", "ovq", "--format", "png,,gif"], "--format"),
                                        (["profile", "ovq", "--mode", "bwd"], "--mode"),
                                        (["profile", "ovq", "--mode", ","], "--mode")],
                         ids=["view", "format", "format-among-good", "mode", "mode-empty"])
def test_bad_name_lists_are_argparse_errors(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {flag}: expected a comma-separated subset" in capsys.readouterr().err


def _train_args(argv: list[str]):
    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize("command, cls, argv", [("train", TrainConfig, []), ("profile", ProfileConfig, ["ovq"]),
                                                ("viz", VizConfig, ["ovq"]), ("demo", DemoConfig, [])])
def test_every_config_field_is_a_flag(command, cls, argv):
    """The flags of train, profile, viz and demo are derived from their configs: each field has a flag, its
    default and a help; no flag is set by hand besides --resume/--resume-from/--stop-after (train) and --trace
    (profile)."""
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    default = cls(**{"method": "ovq"} if cls is VizConfig else {})
    assert config_from_args(cls, parser.parse_args(argv)) == default
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(cls):
        assert f.name in actions, f.name
        help = f.metadata.get("help")
        help = help() if callable(help) else help
        assert help and actions[f.name].help.startswith((help, f"do not {help}")), f.name
    by_hand = {"train": {"resume", "resume_from", "stop_after"}, "profile": {"trace"}}.get(command, set())
    assert set(actions) - {f.name for f in dataclasses.fields(cls)} == {"help"} | by_hand


def test_a_new_train_config_field_appears_as_a_flag():
    @dataclasses.dataclass
    class Config(TrainConfig):
        label_smoothing: float = dataclasses.field(default=0.0, metadata={"help": "label smoothing"})

    parser = argparse.ArgumentParser()
    add_config_flags(parser, Config)
    cfg = config_from_args(Config, parser.parse_args(["--label-smoothing", "0.1", "--keep", "5", "--no-compile"]))
    assert (cfg.label_smoothing, cfg.keep_checkpoints, cfg.compile) == (0.1, 5, False)


@dataclasses.dataclass
class _Config:
    """Every kind of field add_config_flags makes a flag of."""
    name: str = dataclasses.field(default="a", metadata={"positional": True, "help": lambda: "a name"})
    colors: tuple[str, ...] = dataclasses.field(default=("red",), metadata={
        "flag": "--color", "choices": ("red", "green", "blue"), "help": "colours"})
    sizes: tuple[int, ...] = dataclasses.field(default=(1, 2), metadata={"help": "sizes"})
    picks: tuple[int, ...] = dataclasses.field(default=(5,), metadata={
        "flag": "--pick", "repeatable": True, "help": "a pick"})
    label: str | None = dataclasses.field(default=None, metadata={"help": "a label"})
    options: dict = dataclasses.field(default_factory=dict, metadata={"flag": "--opt", "help": "an option"})
    quiet: bool = dataclasses.field(default=False, metadata={"help": "say nothing"})
    exact: bool | None = dataclasses.field(default=None, metadata={"help": "exact (default: decided later)"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress"})
    count: None | int = dataclasses.field(default=None, metadata={"help": "a count"})  # (None first)
    ratios: tuple[float, ...] = dataclasses.field(default_factory=lambda: (0.5,), metadata={"help": "ratios"})
    shapes: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "flag": "--shape", "repeatable": True, "choices": ("square", "round"), "help": "a shape"})


def _parse(cls, argv):
    parser = argparse.ArgumentParser(prog="p")
    add_config_flags(parser, cls)
    return config_from_args(cls, parser.parse_args(argv))


def test_config_flags_of_every_field_kind():
    assert _parse(_Config, ["b"]) == _Config(name="b")
    cfg = _parse(_Config, ["c", "--color", "blue,red", "--sizes", "4,8", "--pick", "3", "--pick", "1", "--label", "x",
                           "--opt", "k=2", "--quiet", "--exact"])
    assert cfg == _Config("c", ("blue", "red"), (4, 8), (3, 1), "x", {"k": 2}, True, True)
    assert _parse(_Config, ["c"]).picks == (5,) and _parse(_Config, ["c"]).colors == ("red",)
    parser = argparse.ArgumentParser(prog="p")
    add_config_flags(parser, _Config)
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["sizes"] == "sizes (default: 1,2)" and helps["colors"] == "colours (default: red)"
    assert helps["progress"] == "do not show progress" and helps["quiet"] == "say nothing"
    assert [_parse(_Config, argv).progress for argv in (["c"], ["c", "--no-progress"])] == [True, False]
    exact = [_parse(_Config, argv).exact for argv in (["c"], ["c", "--exact"], ["c", "--no-exact"])]
    assert exact == [None, True, False]
    assert helps["label"] == "a label" and helps["count"] == "a count"  # no "(default: None)"
    assert helps["ratios"] == "ratios (default: 0.5)" and _parse(_Config, ["c"]).ratios == (0.5,)
    cfg = _parse(_Config, ["c", "--count", "3", "--ratios", "0.25,2", "--shape", "round", "--shape", "square"])
    assert (cfg.count, cfg.ratios, cfg.shapes) == (3, (0.25, 2.0), ("round", "square"))


def test_a_new_config_field_appears_as_a_flag():
    @dataclasses.dataclass
    class Config(ProfileConfig):
        dtypes: tuple[str, ...] = dataclasses.field(default=("fp32",), metadata={
            "flag": "--dtype", "choices": ("fp32", "bf16"), "help": "compute dtypes"})

    cfg = _parse(Config, ["swa", "--dtype", "bf16,fp32", "--mode", "fwd"])
    assert (cfg.target, cfg.dtypes, cfg.modes) == ("swa", ("bf16", "fp32"), ("fwd",))


@pytest.mark.parametrize("argv, match", [
    (["c", "--color", "red,purple"], "argument --color: expected a comma-separated subset of red,green,blue, got "
                                     "'red,purple'"),
    (["c", "--sizes", "4,x"], "argument --sizes: expected comma-separated values of type int, got '4,x'"),
    (["c", "--pick", "x"], "argument --pick: invalid int value: 'x'"),
    (["c", "--shape", "oval"], "argument --shape: invalid choice: 'oval'"),
    ([], "the following arguments are required: name"),
], ids=["choice", "int-list", "repeatable-int", "repeatable-choice", "positional"])
def test_bad_config_flag_values_are_argparse_errors(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        _parse(_Config, argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_a_field_without_a_flag_type_is_refused_by_name():
    @dataclasses.dataclass
    class Config:
        sizes: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="Config.sizes: a field of type <class 'list'> has no command-line flag"):
        add_config_flags(argparse.ArgumentParser(), Config)

    @dataclasses.dataclass
    class Pair:
        pair: tuple[int, int] = (1, 2)  # a fixed-length tuple: not a comma list

    with pytest.raises(TypeError, match="Pair.pair: a field of type <class 'tuple'> has no command-line flag"):
        add_config_flags(argparse.ArgumentParser(), Pair)

    @dataclasses.dataclass
    class Positional:
        sizes: tuple[int, ...] = dataclasses.field(default=(1,), metadata={"positional": True})

    with pytest.raises(TypeError, match="Positional.sizes: a positional argument must be an int, float or str"):
        add_config_flags(argparse.ArgumentParser(), Positional)


def test_train_flags_reach_the_config():
    cfg = config_from_args(TrainConfig, _train_args([
        "--beta1", "0.8", "--beta2", "0.99", "--keep", "3", "--no-compile", "--no-progress", "--deterministic",
        "--task-opt", "key_len=2", "--model-opt", "d_model=32", "--dtype", "fp32", "--ckpt-every", "5"]))
    assert (cfg.beta1, cfg.beta2, cfg.keep_checkpoints, cfg.compile, cfg.progress, cfg.deterministic) == \
        (0.8, 0.99, 3, False, False, True)
    assert config_from_args(TrainConfig, _train_args([])).deterministic is None  # on for CPU, off for CUDA
    assert config_from_args(TrainConfig, _train_args(["--no-deterministic"])).deterministic is False
    assert (cfg.task_options, cfg.model_options, cfg.dtype, cfg.ckpt_every) == ({"key_len": 2}, {"d_model": 32},
                                                                                 "fp32", 5)


def test_beta1_reaches_the_optimizer(tmp_path, monkeypatch):
    import ovqflex.training as training

    seen = {}

    def fake_train(cfg, **kwargs):
        seen["cfg"] = cfg
        return types.SimpleNamespace(loss=None)

    monkeypatch.setattr(training, "train", fake_train)
    assert main(["train", "--beta1", "0.8", "--out", str(tmp_path / "r")]) == 0
    assert seen["cfg"].beta1 == 0.8
    from ovqflex.training.setup import build_optimizer

    opt = build_optimizer(torch.nn.Linear(2, 2), seen["cfg"])
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_train_reports_its_end_on_rank_0_alone_and_says_when_stop_after_cut_it(tmp_path, monkeypatch, capsys):
    """``ovqflex train`` hands --resume, --resume-from and --stop-after to ``train`` and prints one line at
    the end: the steps done, "of N" with how to continue when --stop-after cut the run short; a data-parallel
    rank other than 0 prints nothing (rank 0 speaks for the run)."""
    import ovqflex.training as training

    calls = []

    def fake_train(cfg, **kwargs):
        calls.append(kwargs)
        step = kwargs["stop_after"] or cfg.steps
        return types.SimpleNamespace(loss=1.5, step=step, out=cfg.out, describe=lambda: "loss 1.5")

    monkeypatch.setattr(training, "train", fake_train)
    out = str(tmp_path / "r")
    assert main(["train", "--out", out, "--steps", "6", "--stop-after", "3", "--resume"]) == 0
    assert capsys.readouterr().out == f"trained 3 steps of 6 (--stop-after; --resume continues) -> {out}: loss 1.5\n"
    assert main(["train", "--out", out, "--steps", "6", "--resume-from", "ck"]) == 0
    assert capsys.readouterr().out == f"trained 6 steps -> {out}: loss 1.5\n"
    assert calls == [dict(resume=True, resume_from=None, stop_after=3), dict(resume=False, resume_from="ck",
                                                                              stop_after=None)]
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "--out", out, "--steps", "6"]) == 0
    assert capsys.readouterr().out == ""


def test_eval_hands_on_its_flags_and_prints_the_report(monkeypatch, capsys):
    """``ovqflex eval`` (``evaluate`` stubbed: no run on disk) hands on --lengths, --examples, --batch-size,
    --checkpoint, --device and the parsed --override, with the report named by the overrides (--name wins);
    it prints each length as it is measured, the header with the overrides, the table, and the files written
    (no plot when the report has none)."""
    import ovqflex.training as training

    calls = []

    def evaluate(run, lengths, **kw):
        calls.append((run, lengths, kw))
        kw["progress"](types.SimpleNamespace(length=64, accuracy=0.75, seconds=1.25))
        row = dict(length=64, accuracy=0.75, loss=0.5, targets=12, seconds=1.25)
        return dict(overrides=kw["overrides"], task="icr", task_description="recall", pattern="swa,ovq", step=9,
                    train_seq_len=64, rows=[row], plot=False)

    monkeypatch.setattr(training, "evaluate", evaluate)
    assert main(["eval", "r", "--lengths", "64", "--examples", "3", "--batch-size", "5", "--checkpoint", "step_9",
                 "--device", "cpu", "--override", "max_centroids=16", "--override", "growth=full"]) == 0
    out = capsys.readouterr().out
    assert main(["eval", "r", "--name", "mine"]) == 0
    plain = capsys.readouterr().out
    (run, lengths, kw), (_, default_lengths, default_kw) = calls
    assert (run, lengths, default_lengths) == ("r", [64], None)
    assert {k: v for k, v in kw.items() if k != "progress"} == dict(
        n_examples=3, batch_size=5, overrides={"max_centroids": 16, "growth": "full"}, checkpoint="step_9",
        device="cpu", name="eval-max_centroids-16-growth-full")
    assert {k: v for k, v in default_kw.items() if k != "progress"} == dict(
        n_examples=64, batch_size=8, overrides={}, checkpoint=None, device="auto", name="mine")
    assert "  length      64: accuracy 0.7500  (1.2 s)" in out
    assert ("icr (recall), pattern swa,ovq, step 9, trained at 64 tokens, overrides: max_centroids=16, "
            "growth=full") in out
    assert re.search(r"\n\s*64\s+0\.7500\s+0\.5000\s+12\s+1\.2\n", out), out
    assert "wrote r/eval-max_centroids-16-growth-full.json (no plot: matplotlib is not installed)" in out
    assert "overrides: none" in plain and "wrote r/mine.json (no plot" in plain


def test_probe_hands_on_its_flags_and_prints_each_head(monkeypatch, capsys):
    """``ovqflex probe`` (``probe_run`` stubbed) hands on --length, --examples, --batch-size, --checkpoint and
    --device; it prints the run's line, a row per head and the layers it did not probe."""
    from ovqflex.training import probe

    calls = []

    def probe_run(run, length, **kw):
        calls.append((run, length, kw))
        head = dict(layer=0, mixer="ovq", head=1, pair_weight=0.5, pair_weight_q10=0.25, offsets=[(1, 0.5), (-2, 0.25)])
        return dict(run=run, step=9, pattern="ovq,linear", length=length or 64, queries=12, accuracy=0.75,
                    heads=[head], not_probed=[(1, "linear")])

    monkeypatch.setattr(probe, "probe_run", probe_run)
    assert main(["probe", "r", "--length", "128", "--examples", "3", "--batch-size", "5", "--checkpoint", "step_9",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert main(["probe", "r"]) == 0
    assert calls == [("r", 128, dict(n_examples=3, batch_size=5, checkpoint="step_9", device="cpu")),
                     ("r", None, dict(n_examples=64, batch_size=16, checkpoint=None, device="auto"))]
    assert "r step 9, pattern ovq,linear, 128 tokens: 12 queries, accuracy 0.7500 on their first value token" in out
    assert re.search(r"\n\s*0\s+ovq\s+1\s+0\.500\s+0\.250\s+\+1: 50%  -2: 25%\n", out), out
    assert out.endswith("layer 1 (linear): not probed\n")


@pytest.mark.parametrize("vocab, decode, text", [(256, "functional", True), (300, "static", False),
                                                  (256, "compiled", True)], ids=["bytes", "vocab-300", "compiled"])
def test_generate_loads_its_checkpoint_and_prints_the_text_of_a_byte_model(monkeypatch, capsys, vocab, decode, text):
    """``ovqflex generate`` (``load_run`` stubbed with a model whose ``generate`` answers "hi") loads --checkpoint on
    --device, hands --decode on, prints the new tokens, their text for a byte-level (256-token) vocab alone, and
    says the rate includes the compile for the compiled decodes."""
    from ovqflex.models import HybridConfig, HybridLM

    evaluate = sys.modules["ovqflex.training.evaluate"]  # (the package's attribute of that name is the function)
    model = HybridLM(HybridConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, pattern="swa", window=16))
    calls = []

    def generate(prompt, n, **kw):
        calls.append(kw["decode"])
        return torch.cat([prompt, torch.tensor([[104, 105]])], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    monkeypatch.setattr(evaluate, "load_run", lambda run, checkpoint, device: calls.append((run, checkpoint, device))
                        or (None, None, model, 9))
    assert main(["generate", "r", "--tokens", "1,2", "--checkpoint", "step_9", "--device", "cpu",
                 "--decode", decode]) == 0
    out = capsys.readouterr().out
    assert calls == [("r", "step_9", "cpu"), decode]
    assert f"r step 9, pattern swa, quantize none, decode {decode}" in out and "generated:     104,105" in out
    assert ("as text: 'hi'" in out) == text
    assert ("prefill and compile included" in out) == (decode == "compiled")


def test_demo_runs_the_layer_its_flags_make(capsys):
    """``ovqflex demo``: the sliding-window layer of its flags (printed), the forward's shapes and a training
    step whose loss the seed decides (the layer's init and the input)."""
    argv = ["demo", "--seq-len", "64", "--batch", "1", "--hidden", "32", "--heads", "2", "--window", "8",
            "--sinks", "3"]
    losses = []
    for seed in (1, 2, 1):
        assert main(argv + ["--seed", str(seed)]) == 0
        out = capsys.readouterr().out
        assert "num_heads=2, head_dim=16" in out and "regions=(Sinks(n=3), TokenWindow(window=8))" in out
        assert re.search(r"input x +\(1, 64, 32\)", out) and re.search(r"output y +\(1, 64, 32\)", out)
        losses.append(re.search(r"loss (\d+\.\d+)", out).group(1))
    assert losses[0] == losses[2] != losses[1]


def test_bad_beta_is_refused_by_name(tmp_path, capsys):
    assert main(["train", "--beta2", "1.0", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "beta2 must be in [0, 1), got 1.0" in capsys.readouterr().err


def test_device_default_is_the_same_in_every_command():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    with_device = {name: next(a for a in p._actions if a.dest == "device")
                   for name, p in commands.items() if any(a.dest == "device" for a in p._actions)}
    assert set(with_device) == {"info", "train", "eval", "probe", "experiment", "pilot", "generate", "bench",
                                "profile"}
    assert {(a.default, a.help) for a in with_device.values()} == {("auto", f"{NAMES} (default: auto)")}


def test_a_config_error_is_exit_2_with_its_message(capsys):
    assert main(["viz", "swa", "--opt", "windw=3", "--format", "term"]) == 2
    assert "unknown key 'windw' (did you mean 'window'?)" in capsys.readouterr().err


def test_a_config_type_error_is_exit_2(monkeypatch, capsys):
    def refuse(args):
        raise ConfigTypeError("steps must be an int, got str 'x'")

    monkeypatch.setattr(tools, "_cmd_info", refuse)
    assert main(["info"]) == 2
    assert "ovqflex info: error: steps must be an int, got str 'x'" in capsys.readouterr().err


def test_a_bug_is_not_turned_into_exit_2(monkeypatch):
    """A plain TypeError is a bug: it propagates with its traceback instead of a one-line error."""
    def buggy(args):
        return None + 1

    monkeypatch.setattr(tools, "_cmd_info", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["info"])


@pytest.mark.parametrize("module", ["ovqflex", "ovqflex.cli"])
def test_python_dash_m_runs_the_command_line(module):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, "experiment", "icr", "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("experiment icr, scale cpu")
    bad = subprocess.run([sys.executable, "-m", module, "experiment", "icx"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "icx" in bad.stderr
