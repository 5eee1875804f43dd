"""cuda tier: ``torch.compile(HybridLM)`` trains every mixer pattern of the ``tiny`` preset for 20
steps in fp32 and under bf16 autocast, its loss falls, and dynamo met no graph break and recompiled
nothing (:class:`~ovqflex.compile_watch.CompileWatch`); the compiled model's no-grad forward
equals the eager one; prefill + decode == full forward with flex on CUDA; ``generate`` with the
static, compiled and CUDA-graph decodes gives the functional decode's greedy tokens."""
import pytest
import torch

from ovqflex.compile_watch import CompileWatch
from ovqflex.models import HybridLM, preset
from ovqflex.training.setup import bf16_cpu_codegen
from ovqflex.training.trainer import forward_loss
from tests.cuda.cuda_cases import (CUDA_TIER, DEVICE, FWD_TOL_CUDA, TRAIN_BACKEND, loss_falls, seeded,
                                   skip_old_cpu_inductor_fault)
from tests.helpers import FWD_TOL, assert_close
from tests.ovqflex.cache.test_streaming import HIDDEN, LAYERS, _perturbed, _stream

pytestmark = CUDA_TIER

# one pattern per mixer; the README main job's sw-ovq runs in the default suite, the others with -m cuda
PATTERNS = ["swa,ovq"] + [pytest.param(p, marks=pytest.mark.slow) for p in
                          ("full", "nope", "swa", "bswa", "ovq", "kvm", "vq", "longvq", "linear", "deltanet", "vla")]
VOCAB, STEPS = 64, 20


def _model(pattern: str, **kw) -> HybridLM:
    torch.manual_seed(0)
    options = {"vq": {"codebook_size": 64}, "longvq": {"codebook_size": 64}}
    return HybridLM(preset("tiny", pattern=pattern, vocab_size=VOCAB, backend=TRAIN_BACKEND, mixer_options=options,
                           **kw)).to(DEVICE)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_compiled_hybrid_lm_training_loss_falls(pattern, dtype):
    """20 AdamW steps on one batch (memorisation: the loop and every gradient path must work)."""
    skip_old_cpu_inductor_fault("model", pattern, dtype)
    amp = torch.bfloat16 if dtype == "bf16" else None
    model = _model(pattern)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, VOCAB, (8, 65), generator=seeded(0)).to(DEVICE)
    x, y = x[:, :-1], x[:, 1:]
    losses, notes = [], []
    # as `ovqflex train` runs (in a CPU dry run: docs/torch-versions.md), watched as it watches
    with bf16_cpu_codegen(x.device, amp, True), CompileWatch() as watch:
        for step in range(1, STEPS + 1):
            _, ce, aux = forward_loss(compiled, x, y, amp, with_aux=True)
            loss = ce / y.numel() + aux
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            notes += watch.step(step, tuple(x.shape))
            assert torch.isfinite(loss), f"{pattern} {dtype}: loss {loss.item()}"
            losses.append(loss.item())
    assert loss_falls(losses), f"{pattern} {dtype}: losses {losses}"
    counts = watch.counts()  # compiled whole: no graph break, no recompile across equal steps, nothing left eager
    assert (counts["graph_breaks"], counts["recompiles"], counts["gave_up"]) == (0, 0, 0), (pattern, dtype, notes)


def test_compiled_hybrid_lm_no_grad_forward_equals_eager():
    model = _model("swa,ovq").eval()
    x = torch.randint(0, VOCAB, (2, 300), generator=seeded(1)).to(DEVICE)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)(x)
        eager = model(x)
    assert_close(compiled.cpu(), eager.cpu(), FWD_TOL_CUDA, "compiled no-grad logits")


STREAMED = ["full-rope-conv", "swa-20-sinks", "bswa-2x16", "ovq-plateau", "kvm-fixed", "vq", "longvq", "linear",
            "deltanet", "vla"]


@pytest.mark.parametrize("name", STREAMED)
def test_prefill_then_decode_equals_full_forward(name):
    """The full forward runs flex on CUDA; the cache path runs a prefill and per-chunk decode."""
    torch.manual_seed(3)
    layer = _perturbed(LAYERS[name]())
    if getattr(layer, "backend", None) is not None:
        layer.backend = "flex"
    layer = layer.to(DEVICE)
    x = torch.randn(2, 110, HIDDEN, generator=seeded(3)).to(DEVICE)
    with torch.no_grad():
        full = layer(x)
        streamed, cache = _stream(layer, x, 70, [1, 5, 17])
    assert cache.position == 110
    assert_close(streamed.cpu(), full.cpu(), FWD_TOL[torch.float32] * 10, f"{name} prefill 70 + decode 40")


def test_hybrid_lm_prefill_then_decode_equals_full_forward():
    model = _model("swa,ovq").eval()
    tokens = torch.randint(0, VOCAB, (2, 110), generator=seeded(4)).to(DEVICE)
    with torch.no_grad():
        full = model(tokens)
        streamed, cache = _stream(model, tokens, 70, [1, 5, 17])
    assert cache.position == 110
    assert_close(streamed.cpu(), full.cpu(), FWD_TOL[torch.float32] * 10, "HybridLM prefill 70 + decode 40")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device (a dry run on the CPU)")
@pytest.mark.parametrize("pattern", ["swa,ovq,nope,bswa,kvm", "vq,linear,deltanet,vla,longvq"])
@pytest.mark.parametrize("prompt_len", [5, 21])
def test_graph_generate_gives_the_functional_greedy_tokens(prompt_len, pattern):
    """The compiled static step replayed from one CUDA graph (``decode="graph"``), 60 tokens at B = 2
    through OVQ chunk ends, window wrap-around, block windows, full attention, KVM and VQ absorbs (host
    work between replays) and the recurrences' states (VLA's Cholesky step and refresh inside the
    graph), against the functional decode; static and compiled alike."""
    from tests.ovqflex.models.test_static_generate import _model as small_model

    model = small_model(pattern).to(DEVICE)
    prompt = torch.randint(0, 64, (2, prompt_len), generator=seeded(1)).to(DEVICE)
    want = model.generate(prompt, 60, temperature=0)
    for decode in ("static", "compiled", "graph"):
        assert torch.equal(model.generate(prompt, 60, temperature=0, decode=decode), want), decode
