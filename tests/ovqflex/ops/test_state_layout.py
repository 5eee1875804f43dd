"""Snapshot layout == versioned layout (docs/design.md §5, §9.5): outputs and gradients, every method (OVQ, KVM,
VQ) and schedule, on the blocked and dense backends (flex: forward)."""
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import ovqflex
import ovqflex.attention
import recurrences.versioned
from masks.blocks import build_block_layout
from ovqflex.ops.ovq import ovq_program
from recurrences.versioned import plan_versioned
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close, float64_leaves, grad_floor
from tests.masks.test_blocks import listed
from tests.ovqflex.ops.test_kvm import BUDGETS, params_of
from tests.ovqflex.ops.test_kvm import inputs as kvm_inputs
from tests.ovqflex.ops.test_ovq import inputs as ovq_inputs
from tests.ovqflex.ops.test_vq import inputs as vq_inputs


def state_rows(program):
    return program.geom.n_state


def compare_layouts(run, leaves, seed, backends=("blocked",)):
    """``run(state_layout, backend, *leaves)`` -> output: versioned == snapshot in the forward and every leaf's
    gradient. The snapshot layout's result in float64 (on ``blocked``) is the reference: the versioned layout
    equals it in float64 on each of ``backends`` to float64 precision, and in fp32 (on ``blocked``) to fp32's
    tolerances (both layouts and dtypes route alike: ``float64_leaves``), each gradient at ``grad_floor``."""
    wide = float64_leaves(leaves)
    ref = run("snapshot", "blocked", *wide)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))

    def grads_of(out, xs):
        return torch.autograd.grad((out * w.to(out.dtype)).sum(), xs, allow_unused=True, materialize_grads=True)

    ref_grads = grads_of(ref, wide)
    floor = grad_floor(ref_grads)
    for xs, dtype, on in ((wide, torch.float64, backends), (leaves, torch.float32, ("blocked",))):
        for backend in on:
            out = run("versioned", backend, *xs)
            assert out.dtype == dtype
            assert_close(out, ref, FWD_TOL[dtype], f"{dtype} {backend} forward")
            for i, (a, b) in enumerate(zip(grads_of(out, xs), ref_grads)):
                assert_close(a, b, GRAD_TOL[dtype], f"{dtype} {backend} grad of leaf {i}", floor=floor)


def kvm_run(params, kw):
    """``run`` for :func:`compare_layouts` of the KVM op: the leaves are q, k, v and ``params``' tensors, in order."""
    def run(layout, backend, q, k, v, *tensors):
        return ovqflex.kvm_attention(q, k, v, backend=backend, state_layout=layout, **params_of(params, tensors), **kw)

    return run


@st.composite
def ovq_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    D = draw(st.sampled_from([16, 32]))
    L = draw(st.sampled_from([16, 32, 64]))
    T = draw(st.integers(1, 600))
    growth = draw(st.sampled_from(["plateau", "linear", "full"]))
    kw = dict(chunk_size=L, max_centroids=draw(st.one_of(st.integers(1, 40), st.integers(40, 300))), growth=growth,
              growth_horizon=draw(st.sampled_from([None, 256])) if growth == "linear" else None,
              seeding=draw(st.sampled_from(["spread", "random"])), seed=draw(st.integers(0, 9)),
              normalize_centroids=draw(st.booleans()), checkpoint_every=draw(st.sampled_from([None, 1, 2, 5])),
              block_size=draw(st.sampled_from([16, 32, 64, 128])))
    return B, H, D, T, kw, draw(st.integers(0, 2**16))


@given(ovq_cases())
def test_ovq_versioned_equals_snapshot(case):
    B, H, D, T, kw, seed = case
    event(f"growth {kw['growth']}")
    q, k, v, beta = ovq_inputs(B, H, D, T, seed)

    def run(layout, backend, q, k, v, beta):
        return ovqflex.ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, **kw)

    compare_layouts(run, (q, k, v, beta), seed, backends=("blocked", "dense"))


@pytest.mark.parametrize("growth, seeding, normalize", [("plateau", "spread", False), ("linear", "random", True),
                                                       ("full", "spread", True)],
                         ids=["plateau-spread", "linear-random-normalized", "full-spread-normalized"])
def test_ovq_every_growth_long_enough_to_checkpoint(growth, seeding, normalize):
    """Each growth schedule once with many chunks, several checkpoints and re-versioned slots."""
    q, k, v, beta = ovq_inputs(2, 2, 16, 32 * 22 + 5, seed=9)
    kw = dict(chunk_size=32, max_centroids=90, growth=growth, growth_horizon=512 if growth == "linear" else None,
              seeding=seeding, normalize_centroids=normalize, checkpoint_every=3, block_size=64)

    def run(layout, backend, q, k, v, beta):
        return ovqflex.ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, **kw)

    compare_layouts(run, (q, k, v, beta), seed=9)


@st.composite
def kvm_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    D, C = 16, draw(st.sampled_from([16, 32]))
    Nb = draw(st.integers(1, 3))
    T = (Nb + draw(st.integers(0, 12))) * C + draw(st.sampled_from([C, 1, 7, C // 2 + 3]))
    kw = dict(chunk_size=C, n_bswa_chunks=Nb, sink_len=draw(st.integers(0, 2)),
              rope_dims=draw(st.sampled_from([0, D // 2])), use_vlens=draw(st.booleans()),
              checkpoint_every=draw(st.sampled_from([None, 1, 2, 5])), block_size=draw(st.sampled_from([16, 32, 64])),
              **BUDGETS[draw(st.sampled_from(sorted(BUDGETS)))])
    return B, H, D, T, kw, draw(st.booleans()), draw(st.integers(0, 2**16))


@given(kvm_cases())
def test_kvm_versioned_equals_snapshot(case):
    B, H, D, T, kw, gated, seed = case
    _, _, _, params, leaves = kvm_inputs(B, H, D, T, seed, gated)
    compare_layouts(kvm_run(params, kw), leaves, seed, backends=("blocked", "dense"))


@st.composite
def vq_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    D, C = 16, draw(st.sampled_from([16, 32]))
    T = draw(st.integers(1, 520))
    kw = dict(chunk_size=C, estimator=draw(st.sampled_from(["ste", "diveq"])),
              checkpoint_every=draw(st.sampled_from([None, 1, 2, 5])), block_size=draw(st.sampled_from([16, 32, 64])))
    return B, H, D, T, draw(st.sampled_from([1, 3, 16, 64])), kw, draw(st.booleans()), draw(st.integers(0, 2**16))


@given(vq_cases())
def test_vq_versioned_equals_snapshot(case):
    B, H, D, T, N, kw, local, seed = case
    q, k, v, cb, beta, lb = vq_inputs(B, H, D, T, N, seed)
    lb = lb if local else None

    def run(layout, backend, q, k, v, beta, cb, lb=None):
        return ovqflex.vq_attention(q, k, v, cb, beta, local_bias=lb, backend=backend, state_layout=layout, **kw)[0]

    leaves = (q, k, v, beta, cb) + ((lb,) if local else ())
    compare_layouts(run, leaves, seed, backends=("blocked", "dense"))


@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_kvm_every_budget_long_enough_to_checkpoint(budget):
    """Each budget once with several checkpoints and re-versioned rows (a fixed, readable case)."""
    _, _, _, params, leaves = kvm_inputs(1, 2, 16, 16 * 20 + 9, seed=5)
    kw = dict(chunk_size=16, n_bswa_chunks=2, checkpoint_every=3, block_size=32, **BUDGETS[budget])
    compare_layouts(kvm_run(params, kw), leaves, seed=5)


def test_versioned_layout_is_memory_linear_and_auto_picks_it():
    """At T=4096, N=2048, L=128 the snapshot layout needs n_chunks * N rows; versioned at most 3T + N
    (recurrences/versioned.py::default_every)."""
    q, k, v, beta = ovq_inputs(1, 1, 16, 4096, seed=0, requires_grad=False)
    kw = dict(chunk_size=128, max_centroids=2048)
    snap = ovq_program(q, k, v, beta, state_layout="snapshot", **kw)[0]
    ver = ovq_program(q, k, v, beta, state_layout="versioned", **kw)[0]
    auto = ovq_program(q, k, v, beta, **kw)[0]
    assert state_rows(ver) <= 3 * 4096 + 2048 < state_rows(snap)
    assert state_rows(auto) == state_rows(ver)
    # a small dictionary read by few chunks: snapshots are smaller, auto keeps them
    small = dict(chunk_size=32, max_centroids=40)
    assert state_rows(ovq_program(q[:, :, :128], k[:, :, :128], v[:, :, :128], beta, **small)[0]) == state_rows(
        ovq_program(q[:, :, :128], k[:, :, :128], v[:, :, :128], beta, state_layout="snapshot", **small)[0])


@st.composite
def width_cases(draw):
    method = draw(st.sampled_from(["ovq", "kvm", "vq"]))
    T, L = draw(st.integers(1, 1200)), draw(st.sampled_from([16, 32, 64, 128]))
    return method, T, dict(chunk_size=L, block_size=draw(st.sampled_from([16, 32, 64, 128])),
                           checkpoint_every=draw(st.sampled_from([None, 1, 3]))), draw(st.integers(0, 2**16))


def _program_of(method, T, kw, seed):
    """``build(**options)``: the program of ``method`` (OVQ N = 64, KVM power-law 4 sqrt(ctx) uncapped, VQ N = 32;
    H = 2, D = 16) on inputs that record gradients."""
    if method == "ovq":
        q, k, v, beta = ovq_inputs(1, 2, 16, T, seed)
        return lambda **o: ovq_program(q, k, v, beta, max_centroids=64, **kw, **o)[0]
    if method == "kvm":
        q, k, v, params, _ = kvm_inputs(1, 2, 16, T, seed)
        return lambda **o: ovqflex.kvm_program(q, k, v, **params, budget="power_law", growth_factor=4.0,
                                               max_state_chunks=None, **kw, **o)[0]
    q, k, v, codebook, beta, local = vq_inputs(1, 2, 16, T, 32, seed)
    return lambda **o: ovqflex.vq_program(q, k, v, codebook, beta, local_bias=local, **kw, **o)[0]


@given(case=width_cases())
def test_widths_known_before_the_state_are_the_built_programs(case):
    """The block-list widths ``auto`` weighs under gradients on the blocked backend, known before either state
    is built (``state_program._list_widths``: the regions' ``max_blocks`` alone), are the widths of the
    programs each layout builds; ``auto`` takes the narrower one, ties by fewer rows."""
    from unittest import mock

    from ovqflex.ops import state_program

    method, T, kw, seed = case
    program = _program_of(method, T, kw, seed)
    seen, list_widths = [], state_program._list_widths

    def spy(*args):
        seen.append(list_widths(*args))
        return seen[-1]

    with mock.patch.object(state_program, "_list_widths", spy):
        auto = program()
    built = {layout: program(state_layout=layout) for layout in ("snapshot", "versioned")}
    widths = tuple(built[layout].layout.kv_idx.shape[-1] for layout in ("snapshot", "versioned"))
    event(f"{method}: {'state' if seen else 'no state'}")
    if not seen:  # no chunk reads a state: one program, nothing to choose
        assert built["snapshot"].geom.n_state == built["versioned"].geom.n_state == auto.geom.n_state == 0
        return
    assert seen[0] == widths
    rows = {layout: state_rows(p) for layout, p in built.items()}
    narrower = min(("snapshot", "versioned"), key=lambda layout: (widths[layout == "versioned"], rows[layout]))
    assert state_rows(auto) == rows[narrower] and auto.layout.kv_idx.shape[-1] == widths[narrower == "versioned"]


def test_auto_under_gradients_on_the_blocked_backend_takes_the_narrower_lists():
    """OVQ at 4k (N = 2,048, chunk 128): the snapshot program lists 13 blocks per query block, the versioned one
    17 (``ovqflex bench profiles/memory.toml``: 173 MB kept for the backward against 232), so training on the CPU
    keeps snapshots, though the versioned state has 3.4x fewer rows; a forward alone runs on flex and takes the
    versioned state (docs/design.md §5). At the tiny preset's shapes (chunk 16, blocks of 32, 1k tokens) the
    versioned lists are the narrower too (29 against 45)."""
    for T, kw, want in [(4096, dict(chunk_size=128), "snapshot"),
                        (1024, dict(chunk_size=16, block_size=32), "versioned")]:
        q, k, v, beta = ovq_inputs(1, 2, 16, T, seed=0)
        built = {layout: ovq_program(q, k, v, beta, max_centroids=2048, state_layout=layout, **kw)[0]
                 for layout in ("snapshot", "versioned")}
        assert state_rows(built["versioned"]) < state_rows(built["snapshot"])
        widths = {layout: p.layout.kv_idx.shape[-1] for layout, p in built.items()}
        assert widths == ({"snapshot": 13, "versioned": 17} if T == 4096 else {"snapshot": 45, "versioned": 29})
        assert state_rows(ovq_program(q, k, v, beta, max_centroids=2048, **kw)[0]) == state_rows(built[want])
        with torch.no_grad():
            assert state_rows(ovq_program(q, k, v, beta, max_centroids=2048, **kw)[0]) == state_rows(built["versioned"])


@pytest.mark.parametrize("grad, flex_trains, bound, dtype, per_token", [
    (False, False, None, torch.float32, 2), (True, False, None, torch.float32, 2),
    (True, True, None, torch.float32, 1), (False, False, 1, torch.float32, 1), (False, False, 1, torch.float64, 2)],
    ids=["forward", "blocked-trains", "flex-trains", "snapshot-past-its-bound", "fp64-runs-blocked"])
def test_spacing_is_for_memory_where_memory_decides_and_flex_keeps_the_rows(monkeypatch, grad, flex_trains, bound,
                                                                            dtype, per_token):
    """OVQ at 4k (chunk 128, 32 chunks; N = 2,048 with plateau growth: 1,408 rows by the last chunk):
    checkpoints every 6 chunks (2 rows per token: 6 checkpoints, the last partial) for the forward's speed;
    every 11 (1 row per token: 3 checkpoints) where memory decides (gradients, or a snapshot state past
    SNAPSHOT_MAX_BYTES) and ``auto`` runs the program on flex, which keeps its kv rows. The blocked backend (the
    CPU's training, and every fp64 program) keeps tensors per listed block, so it keeps the speed spacing."""
    monkeypatch.setattr(ovqflex.attention, "flex_trains_on", lambda device: flex_trains)
    if bound is not None:
        monkeypatch.setattr(recurrences.versioned, "SNAPSHOT_MAX_BYTES", bound)
    q, k, v, beta = (x.to(dtype).requires_grad_(grad) for x in ovq_inputs(1, 1, 16, 4096, seed=0, requires_grad=False))
    with torch.set_grad_enabled(grad):
        prog = ovq_program(q, k, v, beta, chunk_size=128, max_centroids=2048, state_layout="versioned")[0]
    assert state_rows(prog) == {2: 6 * 1408 + 4096, 1: 3 * 1408 + 4096}[per_token]


def test_memory_spacing_versioned_equals_snapshot(monkeypatch):
    """Where flex trains, the training program's checkpoints are spaced for memory: still the snapshot's
    outputs and gradients (run on the blocked backend, which the CPU has a backward for)."""
    monkeypatch.setattr(ovqflex.attention, "flex_trains_on", lambda device: True)
    q, k, v, beta = ovq_inputs(1, 2, 16, 600, seed=3)
    kw = dict(chunk_size=32, max_centroids=64, block_size=16)
    n_state = state_rows(ovq_program(q, k, v, beta, state_layout="versioned", **kw)[0])
    plans = {p: plan_versioned(19, 32, 64, 1, align=16, per_token=p) for p in (1, 2)}
    assert n_state == plans[1].state_rows < plans[2].state_rows

    def run(layout, backend, q, k, v, beta):
        return ovqflex.ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, **kw)

    compare_layouts(run, (q, k, v, beta), seed=3)


def test_versioned_blocks_are_listed_by_the_liveness_of_their_rows():
    """A versioned state block is listed full (no mask_mod runs on it) exactly when every query of its query
    block sees all its rows in every batch row and head, and every block with a visible row is listed, also on
    larger blocks (a block then holds state and token rows). In liveness order (each checkpoint's and each
    chunk's rows by death, latest first: recurrences.versioned.liveness_order) most state blocks a query block
    reads are full: with the rows in slot order this case lists 464 partial and 80 full state blocks, in
    liveness order 168 and 270."""
    q, k, v, beta = ovq_inputs(2, 2, 16, 1024, seed=0, requires_grad=False)
    prog = ovq_program(q, k, v, beta, chunk_size=32, max_centroids=128, checkpoint_every=4, state_layout="versioned",
                       block_size=16)[0]
    assert prog.regions[0].every == 4
    for p in (prog, prog.on_blocks(64)):
        g, lay = p.geom, p.layout
        b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1)
        qi, kv = torch.arange(g.q_pad).view(1, 1, -1, 1), torch.arange(g.kv_len).view(1, 1, 1, -1)
        tiles = p.mask_mod(b, h, qi, kv).expand(2, 2, g.q_pad, g.kv_len).reshape(
            2, 2, g.n_q_blocks, g.block_q, g.n_kv_blocks, g.block_kv)
        any_visible = tiles.any(-1).any(-2).any(0).any(0)
        all_visible = tiles.all(-1).all(-2).all(0).all(0)
        partial, full = listed(lay.kv_num, lay.kv_idx, g), listed(lay.full_num, lay.full_idx, g)
        state_only = (torch.arange(g.n_kv_blocks) + 1) * g.block_kv <= g.n_state
        assert not (partial & full).any()
        assert ((partial | full) >= any_visible).all(), "a visible block is not listed"
        assert torch.equal(full & state_only, all_visible & state_only), "full state blocks are not the seen-whole ones"
    g, lay = prog.geom, prog.layout
    state = torch.arange(g.n_kv_blocks) * 16 < g.n_state
    partial, full = listed(lay.kv_num, lay.kv_idx, g), listed(lay.full_num, lay.full_idx, g)
    assert int((full & state).sum()) > int((partial & state).sum()), (partial & state).sum()
    # without the refinement: the regions' candidate blocks, every state block partial, a superset
    cand = build_block_layout(prog.regions, prog.params, g, refine=False)
    cand_partial, cand_full = listed(cand.kv_num, cand.kv_idx, g), listed(cand.full_num, cand.full_idx, g)
    assert not (cand_full & state).any() and (cand_partial >= (partial | full) & state).all()


@pytest.mark.parametrize("method", ["ovq", "kvm"])
def test_flex_forward_versioned_equals_snapshot(method):
    if method == "ovq":
        q, k, v, beta = ovq_inputs(2, 2, 32, 384, seed=1, requires_grad=False)
        kw = dict(chunk_size=32, max_centroids=64, checkpoint_every=2)

        def run(layout, backend):
            return ovqflex.ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, **kw)
    else:
        q, k, v, params, _ = kvm_inputs(2, 2, 32, 384, seed=1, requires_grad=False)
        kw = dict(chunk_size=32, n_bswa_chunks=2, budget="power_law", growth_factor=6.0, max_state_chunks=None,
                  checkpoint_every=2)

        def run(layout, backend):
            return ovqflex.kvm_attention(q, k, v, backend=backend, state_layout=layout, **params, **kw)
    with torch.no_grad():
        assert_close(run("versioned", "flex"), run("snapshot", "blocked"), FWD_TOL[torch.float32], "flex")


@pytest.mark.parametrize("B, T", [(0, 80), (2, 0)], ids=["empty-batch", "no-tokens"])
@pytest.mark.parametrize("layout", ["snapshot", "versioned"])
@pytest.mark.parametrize("method", ["ovq", "kvm", "vq"])
def test_an_empty_batch_or_sequence_gives_an_empty_output_on_every_backend(method, layout, B, T):
    """B = 0 with state in view (T = 5 chunks), and T = 0: an empty output, differentiable, on every backend.
    Flex's lowering had indexed the program's empty captured tensors (IndexError), and the versioned layout's
    block liveness had reduced over no rows. No tokens still make a program of one block of padded queries
    (``masks.program.program_geometry``): none would leave the backends' softmax to reduce over no rows."""
    if method == "ovq":
        q, k, v, beta = ovq_inputs(B, 2, 16, T, seed=0)

        def run(backend):
            return ovqflex.ovq_attention(q, k, v, beta, backend=backend, state_layout=layout, chunk_size=16,
                                         max_centroids=8, checkpoint_every=2)
    elif method == "kvm":
        q, k, v, params, _ = kvm_inputs(B, 2, 16, T, seed=0)

        def run(backend):
            return ovqflex.kvm_attention(q, k, v, backend=backend, state_layout=layout, chunk_size=16,
                                         checkpoint_every=2, **params)
    else:
        q, k, v, codebook, beta, _ = vq_inputs(B, 2, 16, T, 4, seed=0)

        def run(backend):
            return ovqflex.vq_attention(q, k, v, codebook, beta, backend=backend, state_layout=layout, chunk_size=16,
                                        checkpoint_every=2)[0]
    for backend in ("flex", "blocked", "dense", "auto"):
        with torch.no_grad():
            assert run(backend).shape == (B, 2, T, 16), backend
    out = run("blocked")
    assert out.shape == (B, 2, T, 16)
    assert torch.autograd.grad(out.sum(), q)[0].shape == q.shape


@pytest.mark.parametrize("make, match", [
    (lambda: ovqflex.ovq_attention(*ovq_inputs(1, 1, 16, 40, 0, False), max_centroids=8, state_layout="sparse"),
     "state_layout"),
    (lambda: ovqflex.ovq_attention(*ovq_inputs(1, 1, 16, 40, 0, False), max_centroids=8, checkpoint_every=0),
     "checkpoint_every"),
    (lambda: ovqflex.vq_attention(*vq_inputs(1, 1, 16, 40, 4, 0, False)[:5], checkpoint_every=-2), "checkpoint_every"),
    (lambda: ovqflex.kvm_attention(*kvm_inputs(1, 1, 16, 40, 0, requires_grad=False)[:3],
                                   **kvm_inputs(1, 1, 16, 40, 0, requires_grad=False)[3], state_layout="snapshots"),
     "state_layout"),
], ids=["ovq-op-layout", "ovq-op-every", "vq-op-every", "kvm-op-layout"])
def test_bad_state_layout_raises(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()
