"""Run setup: the code width of compiled bf16 runs on the CPU (``bf16_cpu_codegen``)."""
import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import pick_vec_isa

from ovqflex.models import HybridLM, preset
from ovqflex.training import TrainConfig
from ovqflex.training.setup import BF16_CPU_SIMD_BITS, bf16_cpu_codegen, build_task, model_config
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


@pytest.mark.parametrize("width", [128, pick_vec_isa().bit_width()], ids=["narrow", "this-cpus-widest"])
def test_a_width_the_caller_chose_is_kept(width):
    """Even this CPU's widest (AVX-512 where ``WIDE``), when the caller set it."""
    with inductor_config.patch({"cpp.simdlen": width}), bf16_cpu_codegen(CPU, torch.bfloat16, True):
        assert inductor_config.cpp.simdlen == width


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


@pytest.mark.parametrize("change, agreeing, match", [
    (dict(pattern="swa,ovq", model_options={"pattern": "vq"}),
     dict(pattern="swa,ovq", model_options={"pattern": "swa,ovq"}),
     "model_options sets pattern='vq', but --pattern makes it 'swa,ovq': set it in one place"),
    (dict(model_options={"vocab_size": 100}), dict(model_options={"vocab_size": 256}),
     r"model_options sets vocab_size=100, but task 'icr' \(--task-opt vocab_size=N\) makes it 256"),
], ids=["pattern", "vocab_size"])
def test_a_model_option_that_contradicts_the_pattern_or_the_task_is_refused(change, agreeing, match):
    """The pattern flag and the task's vocabulary had silently won over a contradicting model option; the
    same value given twice is no contradiction."""
    cfg = TrainConfig(**change)
    with pytest.raises(ValueError, match=match):
        model_config(cfg, build_task(cfg))
    cfg = TrainConfig(**agreeing)
    assert model_config(cfg, build_task(cfg)) == model_config(TrainConfig(pattern=cfg.pattern), build_task(cfg))


@pytest.mark.parametrize("change, match", [
    (dict(task="text"), r"task 'text' needs a data file: --data FILE"),
    (dict(task="icr", data="notes.txt"), "--data is only used by --task text, not by task 'icr'"),
], ids=["text-without-data", "data-without-text"])
def test_data_goes_with_the_text_task_alone(change, match):
    with pytest.raises(ValueError, match=match):
        build_task(TrainConfig(**change))
