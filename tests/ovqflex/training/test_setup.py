"""Run setup: the code width of compiled bf16 runs on the CPU (``bf16_cpu_codegen``)."""
import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import pick_vec_isa

from ovqflex.models import HybridLM, preset
from ovqflex.training.setup import BF16_CPU_SIMD_BITS, bf16_cpu_codegen
from tests.helpers import assert_finite_grads_close

CPU = torch.device("cpu")
WIDE = pick_vec_isa().bit_width() > BF16_CPU_SIMD_BITS  # this CPU's inductor code is AVX-512


@pytest.mark.parametrize("device, amp, compiled", [
    ("cpu", torch.bfloat16, True), ("cpu", None, True), ("cpu", torch.bfloat16, False), ("meta", torch.bfloat16, True),
], ids=["cpu-bf16-compiled", "cpu-fp32", "cpu-bf16-eager", "other-device"])
def test_only_a_compiled_bf16_run_on_a_wide_cpu_narrows_the_code(device, amp, compiled):
    before = inductor_config.cpp.simdlen
    with bf16_cpu_codegen(torch.device(device), amp, compiled):
        inside = inductor_config.cpp.simdlen
    assert inductor_config.cpp.simdlen == before  # restored
    narrowed = device == "cpu" and amp is torch.bfloat16 and compiled and WIDE
    assert inside == (BF16_CPU_SIMD_BITS if narrowed else before)


def test_a_width_the_caller_chose_is_kept():
    with inductor_config.patch({"cpp.simdlen": 128}), bf16_cpu_codegen(CPU, torch.bfloat16, True):
        assert inductor_config.cpp.simdlen == 128


def test_a_compiled_bf16_deltanet_layer_has_the_eager_gradients_inside_the_context():
    """The case that needs it: the tiny preset's DeltaNet layer compiled (inductor) under bf16 autocast. With
    AVX-512 code its fused backward transposes several bf16 tiles in one loop and its input's gradient is
    NaN (docs/torch-versions.md); inside the context the gradients are finite and the eager ones."""
    torch.manual_seed(0)
    layer = HybridLM(preset("tiny", pattern="deltanet", vocab_size=64)).blocks[1].mixer
    x = torch.randn(8, 64, layer.hidden_size, requires_grad=True)
    params = [x, *(p for p in layer.parameters() if p.requires_grad)]

    def grads(f):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (f(x).float() ** 2).sum()
        return torch.autograd.grad(loss, params)

    with bf16_cpu_codegen(CPU, torch.bfloat16, True):
        got = grads(torch.compile(layer))
    want = grads(layer)
    names = ["x", *(n for n, p in layer.named_parameters() if p.requires_grad)]
    assert_finite_grads_close(got, want, names, torch.bfloat16)
