"""The command line: bench on a small profile, clear errors on bad input."""
import json
import re

import pytest

from ovqflex.cli import build_parser, main


def test_bench_runs_a_profile_and_writes_json(tmp_path, capsys):
    prof = tmp_path / "tiny.toml"
    prof.write_text('name = "tiny"\n[[scenario]]\nkind = "blockmask"\nseq_len = 1024\nchunk_size = 128\nstate_rows = 256\n')
    assert main(["bench", str(prof), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "visible_blocks" in out and "tiny" in out
    rows = json.loads((tmp_path / "out" / "tiny.json").read_text())["rows"]
    # 8 query blocks; chunk c sees its bank (live rows grow with c) and its own block
    assert rows[0]["T"] == 1024 and rows[0]["visible_blocks"] > 8


@pytest.mark.parametrize("text, match", [("name = 'x'\n", "no \\[\\[scenario\\]\\]"),
                                         ("[[scenario]]\nkind = 'nope'\n", "kind must be one of"),
                                         ("[[scenario\n", "not valid TOML")], ids=["empty", "kind", "toml"])
def test_bench_bad_profile(tmp_path, capsys, text, match):
    prof = tmp_path / "bad.toml"
    prof.write_text(text)
    assert main(["bench", str(prof)]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_bench_missing_profile(capsys):
    assert main(["bench", "does/not/exist.toml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_readme_flags_exist():
    parser = build_parser()
    for argv in (["info", "--device", "cpu"], ["demo", "--seq-len", "64", "--batch", "1", "--hidden", "32",
                                                 "--heads", "2", "--window", "8", "--sinks", "1"],
                 ["bench", "p.toml", "--device", "cpu", "--out", "d", "--only", "x"]):
        parser.parse_args(argv)
