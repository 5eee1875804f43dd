"""Every registered method passes the conformance checks (``tests/ovqflex/conformance.py``)."""
import pytest
import torch

from ovqflex.methods import METHODS, method_names
from tests.helpers import FWD_TOL, assert_close
from tests.ovqflex.conformance import CHECKS, HEADS, HIDDEN, layer_of


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", method_names())
def test_method_conforms(name, check):
    CHECKS[check](METHODS[name])


#: methods whose recurrence runs a Python loop over the chunks (VLA's penalty inverse, ``recurrences/vla.py``,
#: whose chunk steps are not associative): a compiled layer unrolls it, so each chunk count is a graph of its own
UNROLLED_CHUNK_LOOP = {"vla"}


@pytest.mark.slow
@pytest.mark.parametrize("name", method_names())
def test_a_compiled_layer_keeps_the_length_symbolic(name):
    """``torch.compile(layer, fullgraph=True)`` with torch's default dynamic shapes, forward and backward
    at three lengths (ragged, ragged, whole blocks): the second length compiles the symbolic graph and
    the third reuses it, except where the chunk loop is unrolled; no graph break; outputs and gradients
    equal the eager layer's (a copy, called in the same order: VQ's codebooks move at every training
    call). Traced by ``aot_eager`` (what inductor would compile, without generating code)."""
    import copy

    from torch._dynamo.utils import counters

    eager = layer_of(METHODS[name])
    layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    graphs = []
    for T in (100, 150, 240):
        x = torch.randn(2, T, HIDDEN, generator=torch.Generator().manual_seed(T))
        before = counters["stats"]["unique_graphs"]
        out = compiled(x)
        out.square().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"] - before)
        ref = eager(x)
        ref.square().mean().backward()
        assert_close(out, ref, 10 * FWD_TOL[torch.float32], f"{name} at T={T}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs == ([1, 1, 1] if name in UNROLLED_CHUNK_LOOP else [1, 1, 0])
    for (what, p), q in zip(eager.named_parameters(), layer.parameters()):
        if p.grad is not None:
            assert_close(q.grad, p.grad, 10 * FWD_TOL[torch.float32], what)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in method_names() if "backend" in METHODS[n].test_options])
def test_a_compiled_layer_under_no_grad_keeps_the_length_symbolic_with_flex(name):
    """``torch.compile(layer, fullgraph=True)`` with the default dynamic shapes under ``no_grad``, on
    ``flex`` (inductor's CPU flex kernel), at three lengths: the second compiles the symbolic graph, no
    graph break, outputs equal to the eager layer's. Before
    ``recurrences.compiling.patch_inductor_cpu_flex_split_names``, every state layer's symbolic graph
    failed to build its C++ kernel (``cur_kvSplitSize7`` undeclared: torch's text replace of a split
    size's name also rewrote ``ks17``). Inductor's caches are off: a kernel cached by a mended run would
    pass without the mend."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    method = METHODS[name]
    torch.manual_seed(0)
    layer = method.build(HIDDEN, HEADS, **{**method.test_options, "backend": "flex"}).eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    graphs = []
    with torch.no_grad(), inductor_config.patch(force_disable_caches=True):
        for T in (100, 150, 240):
            x = torch.randn(2, T, HIDDEN, generator=torch.Generator().manual_seed(T))
            before = counters["stats"]["unique_graphs"]
            out = compiled(x)
            graphs.append(counters["stats"]["unique_graphs"] - before)
            assert_close(out, layer(x), 10 * FWD_TOL[torch.float32], f"{name} at T={T}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[1] == 1, graphs
