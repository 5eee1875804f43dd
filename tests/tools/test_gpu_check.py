"""tools/gpu_check.sh: what it checks before it runs anything (its parts need a GPU)."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"


def test_an_unknown_part_is_refused_by_name_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "tier,decode-singel", str(out)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "unknown part 'decode-singel' in PARTS" in done.stderr
    assert "decode-single" in done.stderr  # the valid parts are listed
    assert not out.exists()  # refused before the first part (tier) ran or any log was written
