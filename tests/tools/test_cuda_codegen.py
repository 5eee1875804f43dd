"""tools/cuda_codegen.py: reading a wrapper's launches, and (with a CUDA build of torch, no GPU needed)
the static routing steps' launch counts as inductor writes them for CUDA."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "cuda_codegen.py"
_spec = importlib.util.spec_from_file_location("cuda_codegen", SCRIPT)
cuda_codegen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_codegen)  # importing it patches nothing: main() does

WRAPPER = '''
def triton_red_fused_max_0(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass

class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        with torch.cuda._DeviceGuard(0):
            buf0 = empty_strided_cuda((8, 128, 2048), (262144, 2048, 1), torch.float32)
            extern_kernels.bmm(arg0_1, arg1_1, out=buf0)
            stream0 = get_raw_stream(0)
            triton_red_fused_max_0.run(buf0, buf1, 1024, 2048, stream=stream0)
            # a comment naming triton_poi_fused_1.run(x) is not a launch
            buf2 = torch.ops.ovqflex.kvm_ln_rows.default(buf1, arg1_1)
            triton_poi_fused_index_put_1.run(buf2, arg0_1, 1024, stream=stream0)
        return (buf2, )
'''


def test_launches_are_the_calls_kernels_library_calls_and_opaque_ops_in_order():
    assert cuda_codegen.launches(WRAPPER) == [
        "extern_kernels.bmm", "triton_red_fused_max_0", "torch.ops.ovqflex.kvm_ln_rows.default",
        "triton_poi_fused_index_put_1"]


#: launches of one static step compiled for CUDA (fused absorb), as inductor wrote them under torch
#: 2.11 (README, GPU routing): a budget a change to a step must not exceed
LAUNCH_BUDGET = {("ovq",): 5, ("ovq", "--normalize-centroids"): 7, ("kvm",): 10}


@pytest.mark.skipif(not (torch.backends.cuda.is_built() and importlib.util.find_spec("triton")),
                    reason="needs a CUDA build of torch with triton (pip install torch==2.11.0); no GPU needed")
@pytest.mark.parametrize("argv", list(LAUNCH_BUDGET), ids=" ".join)
def test_a_static_routing_step_compiled_for_cuda_stays_within_its_launch_budget(argv):
    """A step replayed from a CUDA graph is bound by its launches: each static step's count, from
    inductor's CUDA code generated without a GPU (in a process of its own: the tool patches torch)."""
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    count = int(re.search(r"^(\d+) launches:", done.stdout, re.M).group(1))
    assert count <= LAUNCH_BUDGET[argv], done.stdout
