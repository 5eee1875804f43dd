"""tools/cuda_rules.py: CUDA's autocast and state-sum rules followed on a CPU (each check in a process of its own:
following them registers kernels for ATen ops)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_rules_widen_what_cudas_autocast_widens():
    """Under the CPU's bf16 autocast, ``layer_norm``, ``sum`` and ``exp`` give fp32 as on CUDA (the CPU's rule keeps
    bf16), an explicit ``dtype`` is kept, a matmul stays bf16, and the state sums take CUDA's fp32-accumulating
    branches; a second call changes nothing."""
    code = """
import torch, torch.nn.functional as F
from tools.cuda_rules import follow_cuda_rules
x = torch.randn(4, 8).bfloat16()
def dtypes():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return [str(t.dtype) for t in (F.layer_norm(x, (8,)), x.sum(-1), x.exp(), x.sum(-1, dtype=torch.float64),
                                       x @ x.T.float())]
before = dtypes()
follow_cuda_rules()
follow_cuda_rules()
import recurrences.scan, recurrences.segments
print(before, dtypes(), recurrences.scan.NARROW_SCANS["cpu"], recurrences.segments.NARROW_ADDS["cpu"])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    bf16, f32, f64 = "torch.bfloat16", "torch.float32", "torch.float64"
    assert done.stdout.split("] ")[0] + "]" == str([bf16, bf16, bf16, f64, bf16])
    assert done.stdout.strip().endswith(f"{[f32, f32, f32, f64, bf16]} True True")
