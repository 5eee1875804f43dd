"""VQAttention layer: codebook training (EMA, DiVeQ), compilation, the aux loss in HybridLM
(the op: tests/ovqflex/ops/test_vq.py)."""
import pytest
import torch

import ovqflex
from tests.helpers import assert_trains_compiled_once


def test_layer_ema_mode_updates_codebook_in_train_only_and_returns_aux():
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, backend="blocked")
    assert torch.allclose(layer.beta, torch.full((2,), 4.0))
    assert "codebook" in dict(layer.named_buffers(prefix="")) or "quantizer.codebook" in dict(layer.named_buffers())
    x = torch.randn(2, 64, 32)
    before = layer.quantizer.codebook.clone()
    y, aux = layer(x, return_aux=True)
    assert y.shape == x.shape
    assert {"loss", "commitment", "usage", "perplexity", "unused_codes", "dead_codes", "rel_quant_error"} <= set(aux)
    assert aux["loss"].requires_grad and not aux["usage"].requires_grad
    assert not torch.allclose(layer.quantizer.codebook, before), "training forward must update the codebook"
    assert torch.allclose(layer.quantizer.codebook.norm(dim=-1), torch.ones(2, 8), atol=1e-5)
    layer.eval()
    frozen = layer.quantizer.codebook.clone()
    layer(x)
    assert torch.equal(layer.quantizer.codebook, frozen), "eval forward must not touch the codebook"


def test_layer_bad_codebook_size():
    with pytest.raises(ValueError, match="codebook_size"):
        ovqflex.VQAttention(32, 2, codebook_size=0)


def test_layer_diveq_trains_codebook_by_gradient():
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, estimator="diveq", backend="blocked")
    assert isinstance(layer.quantizer.codebook, torch.nn.Parameter)
    y = layer(torch.randn(2, 64, 32))
    y.square().mean().backward()
    assert layer.quantizer.codebook.grad is not None and layer.quantizer.codebook.grad.abs().sum() > 0
    assert layer.quantizer.idle_steps.max() <= 1  # one step: idle codes count 1, used ones 0


@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_layer_compiles_fullgraph_without_recompile(estimator):
    """The EMA/no-use-penalty buffer updates run inside the compiled graph."""
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=32, codebook_size=16, estimator=estimator, local_bias=True,
                                backend="blocked")
    before = []

    def loss(compiled, step):
        before.append(layer.quantizer.codebook.detach().clone())
        y, aux = compiled(torch.randn(2, 128, 32), return_aux=True)
        return y.square().mean() + aux["loss"]

    def codebook_moved(step):
        assert not torch.equal(layer.quantizer.codebook.detach(), before[step])

    assert_trains_compiled_once(layer, loss, after_step=codebook_moved)


def test_hybrid_model_adds_vq_aux_loss():
    from ovqflex.models import HybridConfig, HybridLM

    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, pattern="swa,vq", window=16, chunk_size=16,
                       block_size=16, backend="blocked", mixer_options={"vq": {"codebook_size": 8,
                                                                               "commitment_weight": 0.5}})
    model = HybridLM(cfg)
    tokens = torch.randint(0, 64, (2, 40))
    logits, aux = model(tokens, return_aux=True)
    assert logits.shape == (2, 40, 64) and aux.dim() == 0 and aux > 0
    k_weight = model.blocks[1].mixer.qkv_proj.weight
    g = torch.autograd.grad(aux, k_weight)[0]
    assert g[32:64].abs().sum() > 0 and g[:32].abs().sum() == 0  # commitment reaches k only
    assert torch.equal(model.eval()(tokens), model(tokens, return_aux=True)[0])
