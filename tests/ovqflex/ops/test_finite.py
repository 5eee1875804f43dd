"""The ``check_finite`` option of every op (docs/design.md §2): with True a nan or inf in any tensor
argument is refused by the argument's name; with False (the default, :func:`ovqflex.finite_checks` off)
no check runs and the op follows its non-finite rule; ``finite_checks()`` turns the default on.
The layers' input check: ``tests/ovqflex/conformance.py::check_finite_input``; the helpers:
``tests/recurrences/test_checks.py``."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import ovqflex
from recurrences.linear import LinearState
from recurrences.vla import VLAState

B, H, T, D = 1, 2, 40, 8


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v, u = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    return dict(q=q, k=k, v=v, u=u, gate=1 + F.elu(torch.randn(B, H, T, generator=g)),
                beta_t=torch.rand(B, H, T, generator=g), beta=torch.ones(H), codebook=torch.randn(H, 6, D, generator=g),
                ln_w=torch.ones(D), ln_b=torch.zeros(D), tau_s=torch.ones(H), tau_b=torch.ones(H),
                local_bias=torch.zeros(H), code_bias=torch.zeros(H, 6), S=torch.zeros(B, H, D, D),
                z=torch.ones(B, H, D), A=torch.eye(D).expand(B, H, D, D).clone())


# name -> (op on a dict of inputs and keyword arguments, {argument name in the error: input it comes from})
QKV = {"q": "q", "k": "k", "v": "v"}
OPS = {
    "causal": (lambda t, **kw: ovqflex.causal_attention(t["q"], t["k"], t["v"], backend="blocked", block_size=16,
                                                        **kw), QKV),
    "swa": (lambda t, **kw: ovqflex.sliding_window_attention(t["q"], t["k"], t["v"], window=8, n_sinks=1,
                                                             backend="blocked", block_size=16, **kw), QKV),
    "ovq": (lambda t, **kw: ovqflex.ovq_attention(t["q"], t["k"], t["v"], t["beta"], chunk_size=16, max_centroids=4,
                                                  backend="blocked", block_size=16, **kw), QKV | {"beta": "beta"}),
    "ovq-program": (lambda t, **kw: ovqflex.attend(ovqflex.ovq_program(t["q"], t["k"], t["v"], t["beta"],
                                                                       chunk_size=16, max_centroids=4, block_size=16,
                                                                       **kw)[0], "blocked"),
                    QKV | {"beta": "beta"}),
    "kvm": (lambda t, **kw: ovqflex.kvm_attention(t["q"], t["k"], t["v"], t["gate"], ln_s_weight=t["ln_w"],
                                                  ln_s_bias=t["ln_b"], tau_state=t["tau_s"], tau_bswa=t["tau_b"],
                                                  chunk_size=16, backend="blocked", block_size=16, **kw),
            QKV | {"gate": "gate", "ln_s_weight": "ln_w", "ln_s_bias": "ln_b", "tau_state": "tau_s",
                   "tau_bswa": "tau_b"}),
    "vq": (lambda t, **kw: ovqflex.vq_attention(t["q"], t["k"], t["v"], t["codebook"], t["beta"],
                                                local_bias=t["local_bias"], code_bias=t["code_bias"], chunk_size=16,
                                                backend="blocked", block_size=16, **kw)[0],
           QKV | {"codebook": "codebook", "beta": "beta", "local_bias": "local_bias", "code_bias": "code_bias"}),
    "linear": (lambda t, **kw: ovqflex.linear_attention(t["q"], t["k"], t["v"], chunk_size=16,
                                                        initial_state=LinearState(t["S"], t["z"]), **kw),
               QKV | {"initial_state.S": "S", "initial_state.z": "z"}),
    "delta": (lambda t, **kw: ovqflex.delta_rule(t["q"], F.normalize(t["k"], dim=-1), t["v"], t["beta_t"],
                                                 chunk_size=16, initial_state=t["S"], **kw),
              {"q": "q", "v": "v", "beta": "beta_t", "initial_state": "S"}),
    "vla": (lambda t, **kw: ovqflex.vla_attention(t["q"], t["k"], t["v"], t["u"], chunk_size=10,
                                                  initial_state=VLAState(t["S"], t["A"], t["z"], 0), **kw),
            QKV | {"u": "u", "initial_state.S": "S", "initial_state.A": "A", "initial_state.z": "z"}),
}
CASES = [(op, arg) for op, (_, args) in OPS.items() for arg in args]


def _poisoned(t: dict, name: str, value: float, at: int = -1) -> dict:
    """The inputs with entry ``at`` (flat index) of ``t[name]`` set to ``value``."""
    bad = t[name].clone()
    bad.view(-1)[at] = value
    return t | {name: bad}


NON_FINITE = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("op, arg", CASES, ids=[f"{op}-{arg}" for op, arg in CASES])
@given(data=st.data())
def test_check_finite_refuses_a_non_finite_argument_by_name(op, arg, data):
    """nan, inf or -inf at 1 to 3 drawn places of one argument: refused naming it, their count and the
    first place (row-major), with ``check_finite=True`` and by default inside ``finite_checks()``."""
    call, args = OPS[op]
    t = _inputs()
    shape = tuple(t[args[arg]].shape)
    places = data.draw(st.sets(st.integers(0, math.prod(shape) - 1), min_size=1, max_size=3), label="places")
    for at in places:
        t = _poisoned(t, args[arg], data.draw(st.sampled_from(NON_FINITE), label="value"), at)
    first = [int(i) for i in torch.unravel_index(torch.tensor(min(places)), shape)]
    message = (f"{arg} must be finite, got {len(places)} non-finite value(s) (nan or inf) in shape {shape}, "
               f"the first at index {first}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call(t, check_finite=True)
    with ovqflex.finite_checks(), pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call(t)


@pytest.mark.parametrize("op", list(OPS))
def test_without_the_check_the_op_runs_on_non_finite_input(op):
    """Off by default (and with ``check_finite=False`` inside ``finite_checks()``): the op runs on a nan in v
    (its non-finite rule, ``ovqflex/attention.py``, decides the output); on finite inputs the checked call
    equals the unchecked one."""
    call = OPS[op][0]
    t = _inputs()
    assert torch.equal(call(t, check_finite=True), call(t))
    bad = _poisoned(t, "v", float("nan"))
    call(bad)
    with ovqflex.finite_checks():
        call(bad, check_finite=False)


def test_check_finite_takes_a_bool_or_none():
    with pytest.raises(TypeError, match=r"check_finite must be a bool or None, got str 'yes'"):
        OPS["linear"][0](_inputs(), check_finite="yes")


def test_compiled_with_fullgraph_a_check_is_refused_and_none_runs_without_one():
    """A compiled graph cannot read values on the host: ``fullgraph=True`` with the check on fails naming
    the option; with it off the op compiles whole, as every compiled op does."""
    t = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: ovqflex.linear_attention(q, k, v, chunk_size=16), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(t["q"], t["k"], t["v"]), ovqflex.linear_attention(t["q"], t["k"], t["v"],
                                                                                  chunk_size=16))
    with ovqflex.finite_checks(), pytest.raises(Exception, match="check_finite=True reads tensor values on the host"):
        compiled(t["q"], t["k"], t["v"])
