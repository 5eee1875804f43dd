"""``HybridLM.generate(decode="static" | "compiled")``: the in-place fast path gives the functional
path's greedy tokens (docs/design.md §6, "Static decode"). ``decode="graph"`` needs CUDA: its
tokens are checked in the cuda tier (``tests/cuda/test_cuda_models.py``), its refusal here."""
import pytest
import torch

from ovqflex.models import HybridConfig, HybridLM
from tests.helpers import perturbed

CONFIG = dict(vocab_size=64, d_model=32, n_heads=2, window=20, chunk_size=16, qk_conv=2,
              backend="dense", mixer_options={"ovq": {"max_centroids": 24}})


def _model(pattern: str) -> HybridLM:
    """Weights moved off their init: at init (std 0.02) the greedy tokens hardly depend on the context (two
    5-token prompts continued by 60 tokens: 10 distinct ids in all), so a static path that absorbed each chunk
    one token late gave the same tokens; perturbed by 0.1, it changes 25 of the 120 new tokens."""
    torch.manual_seed(0)
    return perturbed(HybridLM(HybridConfig(pattern=pattern, n_layers=len(pattern.split(",")), **CONFIG)))


@pytest.mark.parametrize("pattern", ["swa,ovq,nope,bswa,kvm", "vq,linear,deltanet,vla,longvq"])
@pytest.mark.parametrize("prompt_len", [5, 21])
def test_static_generate_gives_the_functional_greedy_tokens(prompt_len, pattern):
    """60 tokens, B = 2: OVQ chunk ends (and, after a 5-token prompt, the first seeding), window
    wrap-around, block windows, full attention, KVM and VQ absorbs, the recurrences' states."""
    model = _model(pattern)
    prompt = torch.randint(0, 64, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    want = model.generate(prompt, 60, temperature=0)
    assert torch.equal(model.generate(prompt, 60, temperature=0, decode="static"), want)


def test_compiled_generate_compiles_once_and_gives_the_same_tokens():
    """Two graphs, each compiled once: the decode step and the OVQ chunk end's routing step (an eager
    step or boundary gives the same tokens: only the graph count tells them apart)."""
    from torch._dynamo.utils import counters

    model = _model("swa,ovq")
    prompt = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    want = model.generate(prompt, 40, temperature=0)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(prompt, 40, temperature=0, decode="compiled"), want)
    assert counters["stats"]["unique_graphs"] == 2


def test_static_generate_refuses_what_it_cannot_do():
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="decode must be one of"):
        _model("swa").generate(prompt, 2, decode="fast")
    model = _model("swa,vq")
    model.blocks[1].mixer.static_cache_type = None  # as a plugged-in method without a static cache
    with pytest.raises(NotImplementedError, match="mixer 'vq' .* has no static"):
        model.generate(prompt, 2, decode="static")
    with pytest.raises(TypeError, match=r"cache must be a ModelCache \(from forward\(\.\.\., use_cache=True\)\), "
                                        r"got dict"):
        model.static_caches({}, 8)


def test_an_empty_prompt_is_refused_by_name():
    """The first new token is sampled from the last prompt token's logits: there must be one."""
    with pytest.raises(ValueError, match=r"prompt must hold at least one token per row .* got shape \(2, 0\)"):
        _model("swa").generate(torch.zeros(2, 0, dtype=torch.long), 3)


@pytest.mark.parametrize("prompt, error, match", [
    (torch.tensor([[3, 64]]), ValueError,
     r"prompt ids must lie in \[0, 64\) \(the model's vocab_size\), got ids from 3 to 64"),
    (torch.tensor([[-1, 5]]), ValueError, r"prompt ids must lie in \[0, 64\) .* got ids from -1 to 5"),
    (torch.tensor([[3.0, 5.0]]), TypeError, "prompt must be int64 token ids, got torch.float32"),
], ids=["vocab", "negative", "float"])
def test_a_prompt_the_embedding_cannot_read_is_refused_by_name(prompt, error, match):
    """An id out of the vocab had reached ``nn.Embedding``: an IndexError on a CPU, on CUDA a device-side
    assert that ends the process's use of the GPU."""
    with pytest.raises(error, match=match):
        _model("swa").generate(prompt, 2)


def test_graph_generate_needs_cuda():
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="decode='graph' .* CUDA device, got cpu; use decode='compiled'"):
        _model("swa,ovq").generate(prompt, 2, decode="graph")
