"""The shared state-program builder (ovqflex/ops/state_program.py, docs/design.md §5): the fork between no
state, the snapshot layout and the versioned layout, on a toy method whose state is slot means."""
from dataclasses import dataclass

import pytest
import torch

import ovqflex
import ovqflex.attention
from masks.regions import OwnChunk, StateBank
from masks.versioned import CheckpointBank, VersionRows
from ovqflex.ops.ovq import ovq_program
from ovqflex.ops.state_program import build_state_program
from recurrences.segments import Snapshots, segment_snapshot_sums
from recurrences.versioned import versioned_means
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close

C, SLOTS = 16, 5


@dataclass(frozen=True)
class Layout:
    chunk_size: int = C
    state_layout: str = "auto"
    checkpoint_every: int | None = None
    block_size: int = 16


def toy_program(q, k, v, state_layout, *, bias_shift=None):
    """Slot means: token ``t`` routes to slot ``t % SLOTS`` and enters the state of the next chunk
    (``lag = 1``); chunk ``c >= 1`` reads all ``SLOTS`` rows, chunk 0 none."""
    T = q.shape[2]
    n_chunks = max(1, -(-T // C))
    routes = (torch.arange(T) % SLOTS).expand(*q.shape[:2], T)
    sizes = [0] + [SLOTS] * (n_chunks - 1)

    def snapshots():
        (ks, vs), counts = segment_snapshot_sums((k, v), routes, C, n_chunks, SLOTS)
        denom = counts.clamp_min(1.0)[..., None]
        return Snapshots(ks / denom, vs / denom, counts, torch.tensor(sizes))

    return build_state_program(q, k, v, OwnChunk(C), scale=q.shape[-1] ** -0.5, sizes=sizes,
                               rows=max(sizes), lag=1, options=Layout(state_layout=state_layout),
                               snapshots=snapshots, versioned=lambda plan: versioned_means(k, v, routes, plan),
                               count_bias=True, bias_shift=bias_shift)


def inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, T, 8, generator=g).requires_grad_(True) for _ in range(3)]


def fail(*_):
    raise AssertionError("the layout not chosen must not be built")


def test_no_state_is_the_window_alone():
    q, k, v = inputs(C - 3)
    program = toy_program(q, k, v, "snapshot")  # one (partial) chunk: no chunk reads a state
    assert program.geom.n_state == 0 and program.bias is None
    assert len(program.regions) == 1 and program.regions[0].name == "window"
    program = build_state_program(q, k, v, OwnChunk(C), scale=1.0, sizes=[0], rows=0, lag=1, options=Layout(),
                                  snapshots=fail, versioned=fail)
    assert program.geom.n_state == 0
    # the ops take the same path: OVQ on a sequence shorter than one chunk reads no dictionary
    program, _, _ = ovq_program(q, k, v, torch.ones(2), chunk_size=C, block_size=16)
    assert program.geom.n_state == 0 and [r.name for r in program.regions] == ["window"]


@pytest.mark.parametrize("layout, regions", [("snapshot", (StateBank,)), ("versioned", (CheckpointBank, VersionRows))])
def test_each_layout_builds_only_its_state(layout, regions):
    q, k, v = inputs(5 * C + 7)
    program = toy_program(q, k, v, layout)
    assert tuple(type(r) for r in program.regions[:-1]) == regions and program.regions[-1].name == "window"
    n_chunks, R = 6, SLOTS
    if layout == "snapshot":
        assert program.geom.n_state == -(-n_chunks * R // 16) * 16
    with pytest.raises(AssertionError, match="not chosen"):  # the chosen builder is the one called
        build_state_program(q, k, v, OwnChunk(C), scale=1.0, sizes=[0] + [R] * 5, rows=R, lag=1,
                            options=Layout(state_layout=layout), snapshots=fail, versioned=fail)


@pytest.mark.parametrize("T", [2 * C, 5 * C + 7, 12 * C])
def test_snapshot_and_versioned_give_equal_outputs_and_gradients(T):
    q, k, v = inputs(T, seed=T)
    bias_shift = torch.tensor([0.3, -1.0]).requires_grad_(True)
    leaves = (q, k, v, bias_shift)
    outs = {}
    for layout in ("snapshot", "versioned", "auto"):
        program = toy_program(q, k, v, layout, bias_shift=bias_shift)
        out = ovqflex.attend(program, "blocked")
        outs[layout] = (program.geom.n_state, out, torch.autograd.grad(out.square().sum(), leaves))
    (n_snap, ref, ref_grads), (n_ver, out, grads) = outs["snapshot"], outs["versioned"]
    assert_close(out, ref, FWD_TOL[torch.float32], "versioned forward")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert_close(a, b, GRAD_TOL[torch.float32], f"versioned grad of leaf {i}")
    # with gradients on the CPU (the blocked backend) auto takes the narrower block lists, ties by fewer rows
    width = {layout: toy_program(q, k, v, layout).layout.kv_idx.shape[-1] for layout in ("snapshot", "versioned")}
    assert outs["auto"][0] == min((width["snapshot"], n_snap), (width["versioned"], n_ver))[1]
    assert all(g.abs().sum() > 0 for g in ref_grads)  # the score pieces reach their parameters


def test_state_scores():
    """The state bias is ``log(count) - bias_shift`` (``-inf`` on empty rows); token rows get no bias; keys are
    the builder's."""
    q, k, v = inputs(3 * C)
    plain = toy_program(q, k, v, "snapshot")
    shifted = toy_program(q, k, v, "snapshot", bias_shift=torch.tensor([1.0, -1.0]))
    S = 3 * SLOTS
    assert torch.equal(shifted.k, plain.k)
    assert torch.equal(shifted.bias[:, :, :S], plain.bias[:, :, :S] - torch.tensor([1.0, -1.0]).view(1, 2, 1))
    assert plain.bias[:, :, :SLOTS].isinf().all()  # chunk 0's (empty) state
    for c in (1, 2):  # chunk c reads the tokens of chunks < c
        counts = torch.bincount(torch.arange(c * C) % SLOTS).float()
        assert torch.equal(plain.bias[:, :, c * SLOTS:(c + 1) * SLOTS], counts.log().expand(2, 2, SLOTS))
    assert (plain.bias[:, :, plain.geom.n_state:] == 0).all()
    with pytest.raises(ValueError, match="bias_shift .* needs count_bias"):
        build_state_program(q, k, v, OwnChunk(C), scale=1.0, sizes=[0, 1], rows=1, lag=1, options=Layout(),
                            snapshots=fail, versioned=fail, bias_shift=torch.zeros(2))


def test_auto_takes_the_faster_layout_without_gradients_and_what_keeps_less_with_them(monkeypatch):
    """VQ (codebook 64, chunk 16, T = 256, lag 2): the snapshot has 4/3 the versioned state rows. On the
    CPU a versioned row costs 2 snapshot rows (recurrences.versioned.LAYOUT_ROW_COST), so a forward
    without gradients keeps the snapshot. With gradients recorded, the layout whose backward keeps less:
    on the CPU's blocked backend the narrower block lists (the snapshot's, 6 blocks against 7); where flex
    trains, fewer rows (versioned)."""
    from ovqflex.ops.vq import vq_program

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 8, generator=g) for _ in range(3))
    codebook, beta = torch.randn(2, 64, 8, generator=g), torch.full((2,), 2.0)
    opts = dict(chunk_size=16, block_size=16)

    def state_rows(layout="auto", **tensors):
        args = {"q": q, "k": k, "v": v, "codebook": codebook, **tensors}
        return vq_program(**args, beta=beta, state_layout=layout, **opts)[0].geom.n_state

    snapshot, versioned = state_rows("snapshot"), state_rows("versioned")
    assert snapshot * 3 == versioned * 4
    assert state_rows() == snapshot
    with torch.no_grad():
        assert state_rows(q=q.clone().requires_grad_()) == snapshot
    widths = [vq_program(q, k, v, codebook, beta, state_layout=layout, **opts)[0].layout.kv_idx.shape[-1]
              for layout in ("snapshot", "versioned")]
    assert widths == [6, 7]
    assert state_rows(q=q.clone().requires_grad_()) == snapshot
    assert state_rows(v=v.clone().requires_grad_()) == snapshot
    monkeypatch.setattr(ovqflex.attention, "flex_trains_on", lambda device: True)
    trained = state_rows("versioned", q=q.clone().requires_grad_())  # checkpoints spaced for memory: 512 rows
    assert trained < versioned and trained == state_rows(q=q.clone().requires_grad_())
    assert state_rows(v=v.clone().requires_grad_()) == trained


def test_auto_takes_fewer_rows_without_gradients_once_the_snapshot_state_passes_its_byte_bound(monkeypatch):
    """The same VQ program without gradients: its snapshot state is 16 chunks x 64 codes = 1,024 rows of
    keys and values of B=2, H=2, D=8 in fp32 (256 bytes a row, over the batch and heads). At a bound of exactly
    those bytes ``auto`` keeps the faster snapshot; one byte less, the versioned layout's fewer rows, its
    checkpoints spaced for memory (recurrences/versioned.py::CHECKPOINT_ROWS_PER_TOKEN)."""
    from ovqflex.ops.vq import vq_program
    from recurrences import versioned

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 256, 8, generator=g) for _ in range(3))
    codebook, beta = torch.randn(2, 64, 8, generator=g), torch.full((2,), 2.0)

    def state_rows(layout="auto"):
        return vq_program(q, k, v, codebook, beta=beta, state_layout=layout, chunk_size=16,
                          block_size=16)[0].geom.n_state

    snapshot, versioned_rows = state_rows("snapshot"), state_rows("versioned")
    assert snapshot == 16 * 64 and versioned_rows < snapshot
    monkeypatch.setattr(versioned, "SNAPSHOT_MAX_BYTES", 1024 * 256)
    assert state_rows() == snapshot
    monkeypatch.setattr(versioned, "SNAPSHOT_MAX_BYTES", 1024 * 256 - 1)
    # and memory decides the checkpoint spacing too: every 4 chunks, not 2 (256 checkpoint rows, not 512)
    assert state_rows() == state_rows("versioned") == 4 * 64 + 256 < versioned_rows == 8 * 64 + 256
