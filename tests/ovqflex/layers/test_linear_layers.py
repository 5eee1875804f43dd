"""Recurrent layers (linear, DeltaNet, VLA): the layer is its projections around the op, every
parameter learns, HybridLM patterns, ``torch.compile(fullgraph=True)`` (docs/design.md §4.6, §9.7)."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ovqflex
from ovqflex.models import HybridLM, preset
from recurrences.reference import delta_rule_reference, linear_attention_reference, vla_reference
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close, assert_compiled_training_matches_eager
from tests.recurrences.recurrent_cases import one_thread  # noqa: F401


def _ref_linear(layer, x):
    q, k, v = layer.split_heads(x)
    # the layer's eps = 50 clamps the read-out's normaliser of the first few tokens (it grows ~8 a token)
    return layer._output(linear_attention_reference(q, k, v, eps=50.0).out, None)


def _ref_delta(layer, x):
    q, k, v = layer.split_heads(x)
    beta = torch.sigmoid(layer.beta_proj(x)).transpose(1, 2)
    return layer._output(delta_rule_reference(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta).out, None)


def _ref_vla(layer, x):
    q, k, v = layer.split_heads(x)
    o = vla_reference(q, k, v, layer.penalty_proj(k), lambda0=layer.options.lambda0,
                      refresh_every=layer.options.refresh_every, refresh_eps=layer.options.refresh_eps,
                      eps=layer.options.eps).out
    return layer._output(o, None)


LAYERS = {
    "linear": (lambda: ovqflex.LinearAttention(24, 3, chunk_size=16, eps=50.0), _ref_linear),
    "deltanet": (lambda: ovqflex.DeltaNetAttention(24, 3, chunk_size=16, qk_conv=3), _ref_delta),
    "vla": (lambda: ovqflex.VLAAttention(24, 3, head_dim=6, chunk_size=10, out_norm=True), _ref_vla),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_equals_reference_loop_on_its_projections(name):
    make, reference = LAYERS[name]
    layer = make()
    x = torch.randn(2, 45, 24, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    ref = reference(layer, x)
    assert_close(y, ref, FWD_TOL[torch.float32], "forward")
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad(y.square().sum(), params)
    ref_grads = torch.autograd.grad(ref.square().sum(), params)
    for (pname, _), a, b in zip([("x", x), *layer.named_parameters()], grads, ref_grads):
        assert b.abs().max() > 0, f"{pname} gets no gradient"
        assert_close(a, b, GRAD_TOL[torch.float32], f"grad {pname}")


@pytest.mark.parametrize("pattern", ["swa,linear", "vla", "deltanet,vla"])
def test_hybrid_patterns_train(pattern):
    model = HybridLM(preset("tiny", pattern=pattern, vocab_size=32, d_model=32, block_size=32))
    tokens = torch.randint(0, 32, (2, 40))
    logits = model(tokens)
    assert logits.shape == (2, 40, 32)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_options_reach_the_op_and_bad_options_are_refused():
    layer = ovqflex.VLAAttention(16, 2, lambda0=0.5, refresh_every=0)
    assert layer.options.lambda0 == 0.5 and layer.options.chunk == 64
    with pytest.raises(TypeError, match=r"VLA options: unknown key 'lamda0' \(did you mean 'lambda0'\?\)"):
        ovqflex.VLAAttention(16, 2, lamda0=0.5)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        ovqflex.LinearAttention(16, 2, chunk_size=0)
    with pytest.raises(ValueError, match="x must have last dim hidden_size=16"):
        ovqflex.DeltaNetAttention(16, 2)(torch.randn(1, 5, 8))


@pytest.mark.parametrize("name", list(LAYERS))
def test_compile_fullgraph_traces_forward_and_backward(name):
    """Dynamo + AOTAutograd trace (``aot_eager``: no inductor codegen, ~1 s): no graph break,
    no recompile for a second batch of the same shape. Inductor itself: the slow test below."""
    counters.clear()
    torch._dynamo.reset()
    layer = LAYERS[name][0]()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 30, 24, requires_grad=True)
    y = compiled(x)
    assert_close(y, layer(x), 1e-6, "compiled forward")
    y.sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    compiled(torch.randn(2, 30, 24, requires_grad=True)).sum().backward()
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_inductor_compiled_training_steps_match_eager():
    """``torch.compile(layer, fullgraph=True)`` with inductor (~10-50 s per layer on CPU)."""
    for name, (make, _) in LAYERS.items():
        torch.manual_seed(0)
        layer, eager = make(), make()
        eager.load_state_dict(layer.state_dict())
        assert_compiled_training_matches_eager(layer, eager, torch.randn(2, 40, 24), what=name)


@pytest.mark.parametrize("name, own", [
    ("LinearAttention", {}),
    ("DeltaNetAttention", {"beta_proj.weight": (4, 32)}),  # W_beta: hidden -> heads, no bias
    ("VLAAttention", {"penalty_proj.weight": (8, 8)}),     # f_theta: head_dim -> head_dim, no bias, shared
])
def test_the_parameters_are_the_documented_ones(name, own):
    """The shared projections, the layer's own map, and with ``out_norm`` one learned gain ``[head_dim]``."""
    layer = getattr(ovqflex, name)(32, 4, out_norm=True)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"qkv_proj.weight": (96, 32), "o_proj.weight": (32, 32), "out_norm.weight": (8,), **own}
