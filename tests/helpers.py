"""Comparison helpers: relative error with per-dtype tolerances."""
import contextlib
import logging
import re

import torch

# forward / gradient tolerances on the relative error, by dtype
FWD_TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 5e-2, torch.float16: 1e-2}

# torch < 2.13 (the GPU machine's 2.11, installed on a CPU machine to check its dynamo): faults of its
# inductor's C++ code generator that 2.13 does not have (docs/torch-versions.md); compiled CPU cases
# that meet them skip with the fault named (on CUDA inductor generates Triton, not this C++)
OLD_TORCH = torch.__version__ < "2.13"  # (TorchVersion compares as a version)
VECMASK_FAULT = "inductor's C++ code generator builds a VecMask<long> from a bool (no such constructor)"
UNDECLARED_FAULT = "inductor's C++ code generator emits a vectorized transpose indexed by an undeclared 'tmp7'"


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-2) -> float:
    """||a - b|| / max(||b||, floor), in float64. The floor keeps analytically-zero
    references (e.g. dq of a one-token softmax) from turning rounding noise into a huge
    ratio: below it the tolerance acts as an absolute bound of tol * floor. Test tensors
    are unit-scale with many entries, so their norms sit far above the floor."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def grad_floor(grads, least: float = 0.1) -> float:
    """The ``floor`` to compare each of ``grads`` (a reference's gradients of one output) with: 1% of the
    largest one's norm, at least ``least``. A gradient's rounding is relative to the computation's scale,
    not to its own size: a per-head scalar (OVQ's and VQ's ``beta``, KVM's ``tau_state``) sums terms from
    every read, which can cancel (KVM's ``tau_state`` gradient, -0.0122 over 435 tokens where v's has norm
    22, came out 1.1e-4 off the float64 one in fp32 at floor 0.1, in either state layout), and a gradient
    that is analytically about 0 (one-token chunks) is the rounding noise of the terms that cancel in it."""
    return max(least, 1e-2 * max(g.norm().item() for g in grads))


def assert_close(a, b, tol, what="", floor: float = 1e-2):
    err = rel_err(a, b, floor)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_parameter_gradients_match(module, out, ref, *, skip=(), may_vanish=(), what=""):
    """The gradient of ``(out * w).sum()`` (one random ``w``) equals that of ``(ref * w).sum()`` for every named
    parameter of ``module`` (fp32 tolerance, floor 0.1), except those whose names start with one of ``skip``; each
    is nonzero (it reaches the parameter) unless its name is in ``may_vanish``."""
    names, params = zip(*module.named_parameters())
    w = torch.randn(out.shape)
    grads = torch.autograd.grad((out * w).sum(), params)
    ref_grads = torch.autograd.grad((ref * w).sum(), params)
    for name, a, b in zip(names, grads, ref_grads):
        if name.startswith(tuple(skip)):
            continue
        assert a.abs().sum() > 0 or name in may_vanish, f"{what}no gradient reaches {name}"
        assert_close(a, b, GRAD_TOL[torch.float32], f"{what}d{name}", floor=0.1)


def float64_leaves(tensors):
    """Float64 copies of ``tensors`` (a None stays None), each a new leaf recording gradients where its
    original does: the same values as fp32 inputs, for the float64 result an fp32 op is measured against.
    (An fp32 result compared with another fp32 result, a reference loop's or another layout's, carries both
    runs' rounding: a gradient that sums many terms to a small value, such as a temperature's, then exceeds
    the fp32 tolerance on rounding alone. The ops route on fp32 copies of the keys, so a float64 run of
    fp32 inputs takes the fp32 run's decisions: docs/precision.md.)"""
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


# the near-tie rule (docs/design.md §4.2 "Near ties", §9): two routings may differ where a token's two
# best choices are within this similarity gap; outputs are then compared under identical routes
NEAR_TIE = 1e-6


def reference_on_routes(run_reference, own=None, **decisions: torch.Tensor):
    """The reference result to compare a fused op with, by the near-tie rule. ``decisions`` are the
    fused op's discrete decisions ([B, H, T] each), named as the reference's result fields and as the
    keywords that force them (``routes=``; KVM ``routes=, founder=``; VQ ``codes=``);
    ``run_reference(**forced)`` runs the reference loop (``own``: its unforced run, if the caller has
    it already). If the loop takes the same decisions, its own run is returned. Otherwise it is run again forced onto the fused decisions, each of which must
    then fall short of the loop's own choice on that history by at most ``NEAR_TIE`` (the result's
    ``gaps``), and the forced run is returned, to compare outputs and gradients with."""
    ref = run_reference() if own is None else own
    differ = {name: getattr(ref, name) != d for name, d in decisions.items()}
    if not any(x.any() for x in differ.values()):
        return ref
    forced = run_reference(**decisions)
    for name, d in decisions.items():
        assert torch.equal(getattr(forced, name), d), f"the reference did not take the forced {name}"
    gaps = forced.gaps.nan_to_num(nan=torch.inf)
    worst = gaps.max()
    at = [int(i) for i in (gaps == worst).nonzero()[0]]
    first = {name: [int(i) for i in x.nonzero()[0]] for name, x in differ.items() if x.any()}
    counts = ", ".join(f"{int(x.sum())} {name}" for name, x in differ.items())
    assert worst <= NEAR_TIE, (
        f"the fused op's decisions differ from the reference loop's ({counts}; the first at {first}), and not "
        f"at near-ties: on the fused decisions' history the one at {at} falls {float(worst):.3e} short of the "
        f"loop's own choice (a near-tie is at most {NEAR_TIE:.0e})")
    return forced


def assert_finite_grads_close(got, want, names, dtype: torch.dtype) -> None:
    """Each gradient of ``got`` is finite and within ``GRAD_TOL[dtype]`` of its twin in ``want``."""
    for g, w, name in zip(got, want, names, strict=True):
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient"
        assert_close(g, w, GRAD_TOL[dtype], f"{name} gradient")


def assert_trains_compiled_once(layer, loss_of, steps: int = 3, after_step=None) -> None:
    """Compile ``layer`` (fullgraph) and take ``steps`` AdamW steps (lr 1e-3) on ``loss_of(compiled, step)``;
    ``after_step(step)`` (if given) runs after each optimizer step. Asserts no graph break and no
    recompile after the first step (every step has the same shapes)."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    for step in range(steps):
        loss_of(compiled, step).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled across equal-shape steps"


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter moved by ``0.1 * N(0, 1)`` and every DiVeQ codebook's codes given 0 to 299
    idle steps (seeded, in place), off its init (unit norms, temperatures 1, tiny weights, no codes' no-use
    bonus) so that every parameter and the bonus matter and outputs depend on the context."""
    from ovqflex.layers.vq import VQCodebook

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for m in module.modules():
            if isinstance(m, VQCodebook) and m.estimator == "diveq":
                m.idle_steps.copy_(torch.randint(0, 300, m.idle_steps.shape, generator=g))
    return module


def prefill_then_decode(layer, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """``layer`` over x ``[B, T, hidden]`` as generation runs it: a prefill of the first ``prefill`` tokens,
    then one token per call from the cache -> the outputs ``[B, T, hidden]`` (compare: the full forward)."""
    y, cache = layer(x[:, :prefill], use_cache=True)
    ys = [y]
    for i in range(prefill, x.shape[1]):
        y, cache = layer(x[:, i:i + 1], cache=cache)
        ys.append(y)
    return torch.cat(ys, dim=1)


def checked_square_loss(layer, x0: torch.Tensor):
    """A ``loss_of`` for :func:`assert_trains_compiled_once`: step 0 runs on ``x0`` and its output is
    checked against the eager layer's; later steps run on fresh N(0, 1) inputs of the same shape."""
    want = layer(x0).detach()

    def loss(compiled, step):
        out = compiled(x0 if step == 0 else torch.randn_like(x0))
        if step == 0:
            assert_close(out, want, FWD_TOL[torch.float32], "compiled == eager")
        return out.square().mean()

    return loss


def assert_compiled_training_matches_eager(layer, eager, x: torch.Tensor, steps: int = 2, what: str = "") -> None:
    """``torch.compile(layer, fullgraph=True)`` and ``eager`` (a copy with the same weights) take
    ``steps`` AdamW steps (lr 1e-2) on ``mean(layer(x)^2)``: no graph break, and the parameters
    agree to the fp32 gradient tolerance."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (layer, eager)]
    for _ in range(steps):
        for model, opt in zip((compiled, eager), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert not counters["graph_break"], what
    for a, b in zip(layer.parameters(), eager.parameters()):
        assert_close(a, b, 1e-5, f"{what} params after {steps} compiled vs eager steps")


def count_router_builds(monkeypatch, module, name: str) -> list:
    """The input shapes of the static routers ``module.<name>`` builds from now on (a counting subclass
    patched in), with the router cache, dynamo's compiled code and its counters emptied: a cold start."""
    from torch._dynamo.utils import counters

    from recurrences import compiling

    made = []
    base = getattr(module, name)

    class Counted(base):
        def __init__(self, shape, **kw):
            made.append(tuple(shape))
            super().__init__(shape, **kw)

    monkeypatch.setattr(module, name, Counted)
    compiling.clear_static_routers()
    torch._dynamo.reset()
    counters.clear()
    return made


def sum_narrow_as_on_cuda(monkeypatch) -> None:
    """Make the CPU take CUDA's choices for bf16/fp16 state sums: a cell's tokens summed in fp32 before
    its one add (``recurrences.segments.NARROW_ADDS``) and scans in fp32, rounded once
    (``recurrences.scan.NARROW_SCANS``)."""
    from recurrences import scan, segments

    monkeypatch.setitem(segments.NARROW_ADDS, "cpu", segments.NARROW_ADDS["cuda"])
    monkeypatch.setitem(scan.NARROW_SCANS, "cpu", scan.NARROW_SCANS["cuda"])


@contextlib.contextmanager
def _records(logger_name: str, keep):
    """The messages of logger ``logger_name`` at INFO and above for which ``keep(message)`` is true,
    while the block runs."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            if keep(record.getMessage()):
                seen.append(record.getMessage())

    logger, handler = logging.getLogger(logger_name), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


_FLOAT_SYMBOL = re.compile(r"create_symbol (zf\d+) = (\S+) for (\S+)")


@contextlib.contextmanager
def default_floats():
    """The symbolic floats dynamo made while the block ran from a float that is not an option passed in:
    a function's default (``__defaults__``, ``__kwdefaults__``) or a module's global, as
    ``(symbol, value, source)``. Under ``dynamic=True`` such a float is symbolic in every torch seen
    (2.11, 2.13), and where traced code uses it as a plain number some versions trace the frame again
    (torch 2.11 for ``clamp_min(eps)``, 2.13 not: docs/design.md §3.5), so none may reach traced code.
    The options a compiled function is given, and an options dataclass's field defaults (symbolic in
    2.11 only), are specialized by ``recurrences.compiling.plain_options`` and are not listed."""
    with _records("torch.fx.experimental.symbolic_shapes", lambda m: m.startswith("create_symbol zf")) as seen:
        found = []
        yield found
    for message in seen:
        m = _FLOAT_SYMBOL.match(message)
        symbol, value, source = m.groups() if m else ("?", "?", message)
        if ("__defaults__" in source or "__kwdefaults__" in source or source.startswith("G[")) and \
                (symbol, value, source) not in found:  # (a restarted trace makes the same symbol again)
            found.append((symbol, value, source))


@contextlib.contextmanager
def dynamo_restarts():
    """The list of the times dynamo restarted its analysis of a frame while the block ran (its
    "Restarting analysis due to ..." log record, at INFO on ``torch._dynamo.convert_frame``): a restart
    traces the whole frame again (docs/design.md §3.5, floats under ``dynamic=True``)."""
    with _records("torch._dynamo.convert_frame", lambda m: m.startswith("Restarting analysis")) as seen:
        yield seen
