"""recurrences/compiling.py: fixed-shape compiled code survives more input shapes than dynamo's
default recompile limit (8), where ``fullgraph=True`` would raise ``FailOnRecompileLimitHit``; the
routing implementation each device gets, the static buffers' row buckets and the router cache."""
import pytest
from hypothesis import given, settings, strategies as st
import torch

from recurrences.compiling import (RECOMPILE_LIMIT, bucket_rows, compile_fixed_shapes, is_symbolic, narrow_rows,
                                  pad_to, plain_float, plain_int, plain_options, size_max, size_min)
from recurrences.kvm import routing_static as kvm_static
from recurrences.ovq import routing_static as ovq_static
from tests.helpers import default_floats, dynamo_restarts


def _double_sum(x):
    return (2 * x).sum(-1)


def test_compiled_function_takes_more_shapes_than_the_default_limit():
    torch.manual_seed(0)
    fn = compile_fixed_shapes(_double_sum)
    assert fn.__wrapped__ is _double_sum
    for n in range(1, 12):  # 11 shapes: one graph each
        x = torch.randn(n, 3)
        torch.testing.assert_close(fn(x), _double_sum(x), rtol=0, atol=0)
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT


def test_static_routing_steps_are_compiled_this_way():
    assert kvm_static.compiled_static_step.__wrapped__ is kvm_static.kvm_static_step
    assert ovq_static.compiled_static_step.__wrapped__ is ovq_static.ovq_static_step


def test_resolve_routing_picks_static_on_cuda_only():
    from recurrences.compiling import ROUTING_IMPLS, resolve_routing

    assert ROUTING_IMPLS == ("auto", "loop", "static")
    assert resolve_routing("auto", torch.device("cpu")) == "loop"
    assert resolve_routing("auto", torch.device("cuda", 0)) == "static"  # a device object needs no GPU
    assert resolve_routing("auto", torch.device("meta")) == resolve_routing("auto", "mps") == "loop"  # CUDA only
    for impl in ("loop", "static"):
        assert resolve_routing(impl, torch.device("cpu")) == resolve_routing(impl, torch.device("cuda")) == impl
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', 'loop', 'static'\], got 'graph'"):
        resolve_routing("graph", torch.device("cpu"))


def test_static_rows_is_the_next_power_of_two():
    from recurrences.compiling import static_rows

    for n in range(1, 5000):
        r = static_rows(n)
        assert r >= n and r & (r - 1) == 0 and (r == 1 or r // 2 < n), n
    assert [static_rows(n) for n in (1, 2, 3, 1366, 2048, 2049)] == [1, 2, 4, 2048, 2048, 4096]


def test_static_router_cache_keeps_the_most_recent_routers():
    from recurrences import compiling

    compiling.clear_static_routers()
    made = []

    def get(key):
        return compiling.static_router(key, lambda: made.append(key) or object())

    first = get("a")
    assert get("a") is first and made == ["a"]  # a hit makes nothing
    for key in "bcd":
        get(key)
    get("a")                                    # "a" is now the most recent: "b" goes next
    get("e")
    assert made == list("abcde") and len(compiling._ROUTERS) == compiling.STATIC_ROUTERS_KEPT == 4
    assert get("a") is first
    get("b")
    assert made == list("abcdeb")               # "b" had been dropped: made again
    compiling.clear_static_routers()
    get("a")
    assert made[-1] == "a" and len(compiling._ROUTERS) == 1
    compiling.clear_static_routers()


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 2**16), L=st.integers(1, 40), n_values=st.sampled_from([2, 5, 1000]),
       with_nan=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_stable_rank_is_the_stable_sorts_inverse_permutation(seed, L, n_values, with_nan, dtype):
    """Ranks equal the positions ``torch.sort(stable=True)`` gives each entry, ties (few distinct
    values), infinities and NaN included (the sort puts NaN last)."""
    from recurrences.compiling import stable_rank

    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([float("-inf"), float("inf"), -0.0, 0.0, 1.5], dtype=dtype)
    values = torch.cat([values, torch.randn(n_values, generator=g, dtype=dtype)])
    if with_nan:
        values = torch.cat([values, torch.tensor([float("nan")], dtype=dtype)])
    key = values[torch.randint(len(values), (3, 2, L), generator=g)]
    order = torch.sort(key, dim=-1, stable=True).indices
    expected = torch.empty_like(order)
    expected.scatter_(-1, order, torch.arange(L).expand_as(order))
    assert torch.equal(stable_rank(key), expected)


def test_replay_or_run_runs_inside_a_callers_capture(monkeypatch):
    """A router replays its graph, except with none or inside a capture of the caller's, where its
    launches must join that graph (a replay cannot be captured)."""
    from recurrences.compiling import replay_or_run

    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    run = lambda: calls.append("run")  # noqa: E731
    replay_or_run(None, run)
    for capturing in (False, True):  # (a CPU build of torch cannot answer the question itself)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        replay_or_run(Graph(), run)
    assert calls == ["run", "replay", "run"]



def test_bucket_rows_rounds_symbolic_sizes_only_and_guards_ranges():
    """Plain ints pass as they are; a symbolic size (dynamic shapes) becomes a power of two at most the
    cap, and the graph holds for every length of its bucket: one graph for n = 10 and 12 (bucket 16),
    another for n = 20 (32), and one for every n past the cap."""
    from torch._dynamo.utils import counters

    assert [bucket_rows(n, 48) for n in (0, 5, 47, 100)] == [0, 5, 47, 100]
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x: x.new_full((1,), bucket_rows(x.shape[0] // 3, 48)), dynamic=True,
                      backend="eager", fullgraph=True)
    got = [int(f(torch.zeros(3 * n))) for n in (10, 12, 20, 100, 200)]
    assert got == [16, 16, 32, 48, 48]
    assert counters["stats"]["unique_graphs"] == 3
    assert int(f(torch.zeros(0))) == 0  # an empty state stays empty


@pytest.mark.parametrize("pick", ["min", "max"])
def test_size_min_and_max_give_one_of_their_sizes_not_an_expression(pick):
    """``size_min``/``size_max`` equal ``min``/``max`` on plain ints. On a symbolic length they pick a side by a
    guard, so the shape built from them is the picked size itself (``s0 // 2``), never ``Min(...)``/``Max(...)``
    (which every later shape would carry into sympy); a length on the other side of the guard compiles anew and
    is still right."""
    from torch._dynamo.utils import counters

    ours, builtin = {"min": (size_min, min), "max": (size_max, max)}[pick]
    assert [ours(a, b) for a, b in ((3, 7), (7, 3), (5, 5))] == [builtin(a, b) for a, b in ((3, 7), (7, 3), (5, 5))]
    shapes = []

    def backend(gm, example_inputs):  # records the symbolic shape of each graph's output
        (out,) = gm.graph.find_nodes(op="output")[0].args[0]
        shapes.append(str(out.meta["example_value"].shape))
        return gm

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x: x.new_zeros(ours(x.shape[0] // 2, 100)), dynamic=True, backend=backend,
                      fullgraph=True)
    lengths = (60, 80, 400, 600) if pick == "min" else (400, 600, 60, 80)
    assert [f(torch.zeros(n)).shape[0] for n in lengths] == [builtin(n // 2, 100) for n in lengths]
    assert counters["stats"]["unique_graphs"] == 2  # one per side of the guard, each serving two lengths
    assert shapes and not any("Min" in s or "Max" in s for s in shapes), shapes


def test_pad_to_and_narrow_rows_equal_pad_and_narrow_on_plain_sizes():
    x = torch.randn(2, 3, 10, 4)
    assert pad_to(x, 2, 10) is x
    assert torch.equal(pad_to(x, -2, 13, value=-1.0), torch.nn.functional.pad(x, (0, 0, 0, 3), value=-1.0))
    assert torch.equal(narrow_rows(x, 2, 2, 5), x[:, :, 2:7])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_padding_to_whole_blocks_and_back_compiles_once_for_every_length(backend):
    """A buffer padded to whole 16-row blocks (``pad_to``) and its real rows taken back (``narrow_rows``),
    forward and backward, under the default dynamic shapes: the second length compiles the symbolic graph,
    which then serves ragged lengths and lengths that fill their blocks alike (an ``if`` on the padding, or
    a slice of the real rows, would guard on that), with the values and gradients of eager code. The
    input is a transposed view: eager ``constant_pad_nd`` keeps its strides for a padding of 0."""
    from torch._dynamo.utils import counters

    def f(x):  # x [T, 3] (a transposed view)
        T = x.shape[0]
        blocks = pad_to(x.t(), 1, -(-T // 16) * 16)  # [3, Tp]
        y = (blocks.view(3, -1, 16) * 2).view(3, -1)
        return narrow_rows(y, 1, 0, T).t().reshape(-1).sin()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    graphs = []
    for T in (100, 150, 240, 37, 64):
        x = torch.randn(3, T).t().requires_grad_()
        out = compiled(x)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        ref = f(x)
        (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
        assert torch.allclose(out, ref) and torch.allclose(grad, ref_grad), T
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 2, 2, 2]


def test_a_size_stays_symbolic_inside_the_range_its_guards_allow():
    """``is_symbolic``: a size whose guards bound it to a range of lengths (a bucket's ``33 <= n <= 64``) is
    still symbolic, one guarded to a single value is not, and a plain int never is."""
    assert not is_symbolic(5)

    def f(x):
        n = x.shape[0]
        if 33 <= n <= 64:  # guards the range
            return x.new_full((1,), 10 + is_symbolic(n))
        return x.new_full((1,), is_symbolic(n))

    torch._dynamo.reset()
    compiled = torch.compile(f, dynamic=True, backend="eager", fullgraph=True)
    assert [int(compiled(torch.zeros(n))) for n in (40, 50, 100)] == [11, 11, 1]

    def pinned(x):
        if x.shape[0] == 7:  # guards the one value
            return x.new_full((1,), is_symbolic(x.shape[0]))
        return x.new_full((1,), 10)

    assert int(torch.compile(pinned, dynamic=True, backend="eager", fullgraph=True)(torch.zeros(7))) == 0


def test_plain_int_and_float_specialize_symbolic_options_with_a_guard():
    """``dynamic=True`` makes the numbers of keyword options a compiled function closes over symbolic:
    ``plain_int`` and ``plain_float`` give their values as plain numbers (usable by code run, not traced,
    at compile time) and guard them, so other values compile anew; plain numbers pass unchanged."""
    from torch._dynamo.utils import counters

    @torch.compiler.assume_constant_result
    def planned(n, f):  # accepts plain values only under torch.compile
        return n * 10 + int(f)

    def with_options(kw):
        return lambda x: x + planned(plain_int(kw["n"]), plain_float(kw["f"]))

    assert (plain_int(3), plain_float(0.1), plain_float(2)) == (3, 0.1, 2.0)
    torch._dynamo.reset()
    counters.clear()
    x = torch.zeros(2)
    calls = [dict(n=3, f=2.5), dict(n=3, f=2.5), dict(n=4, f=2.5), dict(n=4, f=7.0)]
    assert [int(torch.compile(with_options(kw), dynamic=True, backend="eager", fullgraph=True)(x)[0])
            for kw in calls] == [32, 32, 42, 47]
    assert counters["stats"]["unique_graphs"] == 3


def test_plain_options_makes_every_number_of_options_plain_nested_ones_too():
    """``plain_options``: under ``dynamic=True`` the numbers of options made from keywords a compiled
    function closes over are symbolic (an op's ``**kw`` in a ``lambda``); every int and float of the
    options, and of a dataclass inside them, comes out plain, each under a guard, so other values compile
    anew; bools and strings are kept; options with nothing symbolic are returned as they are."""
    from dataclasses import dataclass

    from torch._dynamo.utils import counters

    @dataclass(frozen=True)
    class Inner:
        f: float

    @dataclass(frozen=True)
    class Options:
        n: int
        inner: Inner
        on: bool = True
        name: str = "x"

    def with_options(kw):
        def f(x):
            o = Options(kw["n"], Inner(kw["f"]), kw["on"])
            symbolic = [is_symbolic(o.n), is_symbolic(o.inner.f)]
            p = plain_options(o)
            symbolic += [is_symbolic(p.n), is_symbolic(p.inner.f)]
            return x + p.n + p.inner.f, x.new_tensor(symbolic + [p.on is o.on and p.name == o.name], dtype=torch.bool)
        return f

    plain = Options(3, Inner(0.5))
    assert plain_options(plain) is plain
    torch._dynamo.reset()
    counters.clear()
    x = torch.zeros(2)
    calls = [dict(n=3, f=0.5, on=True), dict(n=3, f=0.5, on=True), dict(n=4, f=0.5, on=False),
             dict(n=4, f=2.0, on=False)]
    outs = [torch.compile(with_options(kw), dynamic=True, backend="eager", fullgraph=True)(x) for kw in calls]
    assert [float(out[0][0]) for out in outs] == [3.5, 3.5, 4.5, 6.0]
    assert outs[0][1].tolist() == [True, True, False, False, True]  # symbolic in, plain out, the rest kept
    assert counters["stats"]["unique_graphs"] == 3


_FLOAT_COST = {"cpu": 2.0}  # the control: a float in a module dict, as the layout's row costs were


@pytest.mark.parametrize("helper", ["float-in-a-module-control", "pad_to", "check_number", "auto-layout"])
def test_the_helpers_own_numbers_do_not_restart_a_symbolic_trace(helper):
    """Under ``dynamic=True`` dynamo reads a float from a module dict (torch 2.11 and 2.13) or a default
    argument (2.13) as a symbolic float; one used as a plain number (a padding value, a bound compared
    with, the layout choice's row cost) makes it trace the frame again (docs/design.md §3.5). The helpers
    every op calls take ints there: no restart. The control, a module dict's float used as a plain
    number, restarts (so the restarts are seen)."""
    from recurrences.checks import check_number
    from recurrences.versioned import choose_state_layout, plan_versioned

    def auto_layout(x):
        T = x.shape[-1]
        plan = plan_versioned(n_chunks=T // 16, chunk_size=16, rows=64, lag=1)
        layout = choose_state_layout("auto", n_chunks=T // 16, rows=64, plan=plan, device_type="cpu")
        return x * (2 if layout == "versioned" else 3)

    body = {"float-in-a-module-control": lambda x: x * (2 if x.shape[-1] * plain_float(_FLOAT_COST["cpu"]) < 100
                                                         else 3),
            "pad_to": lambda x: pad_to(x, 1, 40) + 1,
            "check_number": lambda x: x * check_number("scale", 2.5),
            "auto-layout": auto_layout}[helper]
    x = torch.randn(3, 32)
    torch._dynamo.reset()
    with dynamo_restarts() as restarts, default_floats() as floats:
        out = torch.compile(body, dynamic=True, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, body(x))
    assert len(restarts) == (1 if helper == "float-in-a-module-control" else 0), restarts
    # the control's float is seen where it was born, whether or not a torch version restarts for it
    assert [source for _, _, source in floats] == (["G['_FLOAT_COST']['cpu']"]
                                                  if helper == "float-in-a-module-control" else []), floats


_SCATTER_ADD_SCRIPT = """
import torch
from recurrences.compiling import prepare_compile

prepare_compile()  # what a layer does when made
torch._dynamo.reset()  # drops dynamo's compile callbacks: the mend must not depend on one
torch.manual_seed(0)
torch.set_num_threads(2)
V, D, B, T = 64, 128, 8, 63
emb = torch.randn(V, D, requires_grad=True)
a = torch.randn(B, T, D)
c = [torch.randn(D, B, T) for _ in range(3)]


def loss(ids):
    h = emb[ids]  # [B, T, D]; its backward is a scatter-add into emb's gradient
    hp = h.permute(2, 0, 1)  # most gradient terms laid out [D, B, T]: a transposing 2-D tile kernel
    return (h * a).tanh().sum() + (hp * c[0]).sin().sum() + (hp * c[1]).cos().sum() + (hp * c[2]).tanh().sum()


ids = torch.randint(0, V, (B, T))
loss(ids).backward()
eager, emb.grad = emb.grad.clone(), None
torch.compile(loss)(ids).backward()
print((emb.grad - eager).abs().max().item())
"""


def test_inductor_scatter_add_is_mended_after_a_dynamo_reset():
    """torch 2.13's inductor maps the index of a threaded scatter-add in a transposing CPU tile twice
    (``patch_inductor_cpu_atomic_add``): this embedding backward then writes past its gradient (the
    script aborts with heap corruption without ``prepare_compile``, checked by hand on torch 2.13).
    ``prepare_compile`` mends it when inductor's code generator is imported, so a ``torch._dynamo.reset()``
    between making a layer and compiling it
    leaves it mended. A fresh process, caches off: the mend is process-wide."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    run = subprocess.run([sys.executable, "-c", _SCATTER_ADD_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) < 1e-4, run.stdout


def test_prepare_compile_mends_the_cpu_flex_kernels_names_of_its_split_sizes():
    """torch 2.13's CPU flex template renames its split sizes by a plain text replace that also rewrites
    longer size names (``patch_inductor_cpu_flex_split_names``); after ``prepare_compile`` the template
    generates its score and mask code through the mended ``modification``, whether it was imported
    before or after. (That a layer's symbolic graph then builds is checked for every layer by
    ``tests/ovqflex/test_conformance.py::test_a_compiled_layer_under_no_grad_keeps_the_length_symbolic_with_flex``,
    slow.)"""
    import torch._inductor.kernel.flex.flex_cpu  # noqa: F401 (how inductor loads the template)
    from torch._inductor.codegen.cpp_flex_attention_template import CppFlexAttentionTemplate

    from recurrences.compiling import prepare_compile

    prepare_compile()
    assert CppFlexAttentionTemplate.modification.__name__ == "mended_modification"


def test_realize_is_an_identity_with_gradients_through_it():
    """The extern identity (flex's captured tensors, exact fp32 copies of bf16 keys) copies its input
    and keeps a captured bias trainable."""
    from recurrences.compiling import realize

    x = torch.randn(5, requires_grad=True)
    y = realize(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    (g,) = torch.autograd.grad((y * torch.arange(5.0)).sum(), x)
    assert torch.equal(g, torch.arange(5.0))
