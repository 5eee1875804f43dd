"""LongVQ block (LongVQ paper; docs/design.md §4.5): local bias, compile, the copy task (slow); causality and the
other method properties are in test_conformance.py."""
import time

import pytest
import torch
import torch.nn.functional as F

import ovqflex
from ovqflex.models import HybridConfig, HybridLM
from ovqflex.tasks import IGNORE, make_batch, make_task
from recurrences.ema import damped_ema_reference
from recurrences.reference import vq_attention_reference
from tests.helpers import FWD_TOL, assert_close, assert_parameter_gradients_match, assert_trains_compiled_once


def block(**kw):
    torch.manual_seed(0)
    return ovqflex.LongVQBlock(32, 2, **({"chunk_size": 16, "codebook_size": 8, "backend": "blocked"} | kw))


def _block_reference(layer, x, norm_eps):
    """The block by the LongVQ paper's equations (as ``ovqflex/layers/longvq.py``'s docstring writes them), the EMA's
    token loop and VQ-attention's quadratic form in place of the fused ops, on the layer's parameters (its norms'
    epsilon ``norm_eps``)."""
    H, Dk, Dv, hidden = layer.num_heads, layer.head_dim, layer.head_dim_v, layer.hidden_size
    B, T, _ = x.shape
    z = F.silu(damped_ema_reference(x, layer.ema_delta, layer.ema_alpha, layer.ema_beta, layer.ema_gamma,
                                    layer.ema_omega))
    w_q, w_k, w_g = layer.z_proj.weight.split([H * Dk, H * Dk, H * Dv])
    b_q, b_k, b_g = layer.z_proj.bias.split([H * Dk, H * Dk, H * Dv])
    w_v, w_o = layer.x_proj.weight.split([H * Dv, hidden])
    b_v, b_o = layer.x_proj.bias.split([H * Dv, hidden])
    heads = lambda t, d: t.view(B, T, H, d).transpose(1, 2)  # noqa: E731
    q, k = heads(F.linear(z, w_q, b_q), Dk), heads(F.linear(z, w_k, b_k), Dk)
    g_a, g_o = F.silu(F.linear(z, w_g, b_g)), torch.sigmoid(F.linear(x, w_o, b_o))
    v = heads(F.silu(F.linear(x, w_v, b_v)), Dv)
    attn = vq_attention_reference(q, k, v, layer.quantizer.codebook, layer.beta, chunk_size=layer.chunk_size,
                                  local_bias=layer.local_bias, estimator=layer.estimator,
                                  code_bias=layer.quantizer.code_bias()).out
    o_a = layer.h_proj(g_a * attn.transpose(1, 2).reshape(B, T, H * Dv))
    norm = lambda t, n: F.layer_norm(t, (hidden,), n.weight, n.bias, norm_eps)  # noqa: E731
    y = norm(g_o * o_a + (1 - g_o) * x, layer.norm1)
    return norm(y + layer.ffn(y), layer.norm2)


@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_block_equals_the_papers_equations_with_the_reference_loops(estimator):
    """Forward and the gradient of every parameter, with the local bias, the norms and (DiVeQ) the codes'
    no-use penalty away from their initial values, in eval mode (a frozen codebook: the training forward's
    update is tests/ovqflex/layers/test_vq.py's). Where queries read chunks through the codebook state (80
    tokens, 5 chunks), a key read there gets its code's mean gradient (``ovqflex.vq_attention``'s documented
    rule), so the parameters before the quantized keys (the EMA's, ``z_proj``'s, DiVeQ's codebook) are compared
    where every query reads the keys as tokens (32 tokens, 2 chunks), and the others at both lengths."""
    layer = block(estimator=estimator, norm_eps=1e-3).eval()
    with torch.no_grad():
        for p in (layer.local_bias, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight, layer.norm2.bias):
            p.add_(0.5 * torch.randn_like(p))
        if estimator == "diveq":
            layer.quantizer.idle_steps.copy_(torch.randint(0, 50, layer.quantizer.idle_steps.shape))
    for T in (80, 32):
        x = torch.randn(2, T, 32)
        out, ref = layer(x), _block_reference(layer, x, norm_eps=1e-3)
        assert_close(out, ref, FWD_TOL[torch.float32], f"block forward, T={T}")
        before_keys = ("ema_", "z_proj", "quantizer") if T > 2 * layer.chunk_size else ()
        # with no state rows read (T = 32) the local bias shifts every score alike: no gradient reaches it
        no_state = ("local_bias",) if T <= 2 * layer.chunk_size else ()
        assert_parameter_gradients_match(layer, out, ref, skip=before_keys, may_vanish=no_state, what=f"T={T}: ")


def test_local_bias_is_learned_and_changes_the_output():
    layer = block().eval()
    x = torch.randn(1, 80, 32)
    y = layer(x)
    (y * torch.randn(y.shape)).sum().backward()
    assert layer.local_bias.grad is not None and layer.local_bias.grad.abs().sum() > 0
    with torch.no_grad():
        layer.local_bias.fill_(3.0)
        y2 = layer(x)
    assert torch.allclose(y[:, :32], y2[:, :32], atol=1e-5)  # chunks 0, 1 read no state: a uniform shift
    assert not torch.allclose(y[:, 32:], y2[:, 32:], atol=1e-3)


def test_compiles_fullgraph_without_recompile():
    def loss(compiled, step):
        y, aux = compiled(torch.randn(2, 64, 32), return_aux=True)
        return y.square().mean() + aux["loss"]

    assert_trains_compiled_once(block(), loss)


def test_longvq_pattern_builds_standalone_blocks():
    cfg = HybridConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=2, pattern="longvq", chunk_size=16,
                       block_size=16, backend="blocked", mixer_options={"longvq": {"codebook_size": 8}})
    model = HybridLM(cfg)
    assert all(b.standalone and not hasattr(b, "mlp") for b in model.blocks)
    logits, aux = model(torch.randint(0, 32, (2, 40)), return_aux=True)
    assert logits.shape == (2, 40, 32) and aux > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_heads=4"):
        ovqflex.LongVQBlock(30, 4)
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of 16, got 10"):
        ovqflex.LongVQBlock(32, 2, chunk_size=10)
    with pytest.raises(ValueError, match="x must have last dim"):
        block()(torch.randn(1, 8, 16))
    for option, bad, match in (("ema_dim", 0, "ema_dim must be >= 1, got 0"),
                               ("ffn_ratio", 0, "ffn_ratio must be a finite number > 0, got 0"),
                               ("norm_eps", 0.0, "norm_eps must be a finite number > 0, got 0.0"),
                               ("commitment_weight", -1.0, "commitment_weight must be a finite number >= 0, got -1.0"),
                               ("head_dim", 0, "head_dim must be >= 1, got 0")):
        with pytest.raises(ValueError, match=match):
            ovqflex.LongVQBlock(32, 2, **{option: bad})


def test_the_ffn_width_is_ffn_ratio_times_hidden():
    block = ovqflex.LongVQBlock(32, 2, ffn_ratio=3.0)
    assert (block.ffn[0].weight.shape, block.ffn[2].weight.shape) == ((96, 32), (32, 96))


def test_initial_values_and_repr():
    """beta starts at sqrt of the *key* head dim (``head_dim=8``, values of 16), the local bias at 0, and the
    EMA's expansion beta at +1, -1, +1, ... over the EMA dims plus N(0, 0.02) noise (MEGA's initialisation)."""
    torch.manual_seed(0)
    layer = ovqflex.LongVQBlock(32, 2, head_dim=8, ema_dim=4)
    assert (layer.head_dim, layer.head_dim_v) == (8, 16)
    assert torch.equal(layer.beta, torch.full((2,), 8**0.5)) and torch.equal(layer.local_bias, torch.zeros(2))
    assert (layer.ema_beta - torch.tensor([1.0, -1.0, 1.0, -1.0])).abs().max() < 0.12  # 6 sigma
    assert layer.extra_repr() == "hidden_size=32, num_heads=2, head_dim=8, chunk_size=128, backend='auto'"


@pytest.mark.slow
def test_two_layer_longvq_learns_the_copy_task():
    """Eager AdamW on the copy task (vocab 16, 8 tokens, SEP, the 8 again: T = 17, chunks of 16).
    Only the window region is exercised (no query reads the codebook state at T = 17). Longer
    copies learn late or not at all (measured, same settings): 16 tokens (T = 33, every source
    in the window) leave chance (ln 14) only after ~550 steps; 24 tokens (T = 49, queries 32-39
    reach sources 8-15 only through the codebook state) stay at chance for 1,500 steps, window
    targets included. Every key is quantized, the window's too, and the block's only positional
    signal is the EMA — open problem, see the issue-5 report."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    task = make_task("copy", vocab_size=16, n_tokens=8)
    T = task.min_len()
    model = HybridLM(HybridConfig(vocab_size=16, d_model=64, n_heads=2, n_layers=2, pattern="longvq", chunk_size=16,
                                  block_size=16, backend="blocked", mixer_options={"longvq": {"codebook_size": 32, "ema_decay": 0.9}}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    t0, losses = time.perf_counter(), []
    for step in range(STEPS):
        x, y = make_batch(task, seed=0, step=step, start=0, count=32, seq_len=T)
        logits, aux = model(x, return_aux=True)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-20:]) / 20
    print(f"LongVQ copy task: loss {start:.3f} -> {end:.3f} in {STEPS} steps, {time.perf_counter() - t0:.0f} s")
    assert end < 0.6 * start


STEPS = 300
