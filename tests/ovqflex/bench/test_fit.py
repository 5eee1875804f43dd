"""Log-log slopes and the bench plot/JSON."""
import json

import matplotlib.image as mpimg
import pytest

from ovqflex.bench.fit import fit_rows, loglog_slope, plot_loglog
from ovqflex.cli import main


def test_slopes_of_power_laws():
    Ts = [1024, 512, 4096]  # in no order: the fit's range is the lengths' smallest and largest
    rows = [{"scenario": f"s{t}", "series": "s", "case": "quad", "T": t, "time_s": 3e-9 * t**2, "peak_mb": 0.01 * t} for t in Ts]
    rows += [{"scenario": "s", "case": "one length", "T": 512, "time_s": 1.0}]
    rows += [{"scenario": "s8192", "series": "s", "case": "quad", "T": 8192, "error": "out of memory"}]  # no figure
    (fit,) = fit_rows(rows)
    assert (fit["series"], fit["case"]) == ("s", "quad") and fit["T"] == "512..4096"
    assert fit["slope_time_s"] == pytest.approx(2.0) and fit["slope_peak_mb"] == pytest.approx(1.0)
    assert loglog_slope([1, 2], [5, None]) is None
    assert loglog_slope([64, 64], [1.0, 2.0]) is None  # two points, one length
    # positive points only (a CPU row's peak is resident-set growth: 0 or below for a case that freed memory)
    assert loglog_slope([64, 128, 256, 512], [0.0, 1.0, 2.0, -3.0]) == pytest.approx(1.0)


def test_batches_are_separate_series():
    """Decode rows of several batch sizes: one fit per (case, batch), never one across batches."""
    rows = [{"scenario": "d", "case": "full", "batch": b, "T": t, "time_s": b * 1e-6 * t} for b in (1, 16)
            for t in (1024, 4096)]
    fits = fit_rows(rows)
    assert [(f["series"], f["batch"]) for f in fits] == [("d", 1), ("d", 16)]  # without a series key: the scenario
    assert all(f["slope_time_s"] == pytest.approx(1.0) for f in fits)


def test_plot_written_only_with_two_lengths(tmp_path):
    assert plot_loglog([{"scenario": "a", "T": 8, "time_s": 1.0}], tmp_path / "none.png") is None
    assert plot_loglog([{"scenario": "a", "T": 8, "time_s": t} for t in (1.0, 2.0)], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    rows = [{"scenario": "a", "case": "c", "T": t, "time_s": t * 1e-3, "peak_mb": 1.0 + t} for t in (64, 256)]
    path = plot_loglog(rows, tmp_path / "p.png")
    assert mpimg.imread(path).ndim == 3


def test_bench_writes_fits_plot_and_matmul_rate(tmp_path, capsys):
    prof = tmp_path / "bm.toml"
    scen = '[[scenario]]\nname = "{n}"\nseries = "bank"\nkind = "blockmask"\nseq_len = {t}\nchunk_size = 128\nstate_rows = 256\nrepeats = 1\n'
    prof.write_text('name = "bm"\n' + "".join(scen.format(n=f"bank{t}", t=t) for t in (1024, 4096)))
    assert main(["bench", str(prof), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out
    doc = json.loads((tmp_path / "bm.json").read_text())
    assert doc["meta"]["matmul_gflops"] > 0
    assert [r["scenario"] for r in doc["rows"]] == ["bank1024", "bank4096"]
    (fit,) = doc["fits"]
    assert fit["series"] == "bank" and fit["T"] == "1024..4096" and "log-log slopes" in out
    assert mpimg.imread(tmp_path / "bm.png").ndim == 3
