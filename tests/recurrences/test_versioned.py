"""The versioned state build (docs/design.md §5): every query chunk sees exactly its snapshot."""
import functools
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from recurrences.segments import segment_snapshot_sums
from recurrences.versioned import (LAYOUT_ROW_COST, SNAPSHOT_MAX_BYTES, choose_state_layout, default_every,
                                   memory_decides, plan_versioned, snapshot_from_versioned, versioned_sums)
from tests.helpers import rel_err, sum_narrow_as_on_cuda


def random_routes(B, H, T, chunk, lag, sizes, drop, g):
    """Routes obeying the layouts' precondition: a token entering at chunk e routes to a slot < sizes[e];
    a fraction ``drop`` is unrouted (-1). Tokens entering past the last chunk get any slot."""
    n_chunks = len(sizes)
    entry = torch.arange(T) // chunk + lag
    cap = torch.tensor([sizes[min(e, n_chunks - 1)] for e in entry.tolist()])
    r = (torch.rand(B, H, T, generator=g) * cap).long()
    dead = (cap == 0) | (torch.rand(B, H, T, generator=g) < drop)
    return torch.where(dead, -1, r)


@st.composite
def cases(draw):
    chunk = draw(st.sampled_from([16, 32]))
    n_chunks = draw(st.integers(1, 12))
    T = (n_chunks - 1) * chunk + draw(st.integers(1, chunk))
    lag = draw(st.integers(1, 3))
    # non-decreasing sizes, 0 for the first `lag` chunks; few slots (many re-versions) or many
    cap = draw(st.sampled_from([3, 20, 70]))
    sizes, n = [], 0
    for c in range(n_chunks):
        if c >= lag:
            n = min(cap, n + draw(st.integers(0, chunk)))
        sizes.append(n)
    every = draw(st.one_of(st.none(), st.integers(1, 5)))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 2)), T=T, chunk=chunk, lag=lag, sizes=sizes,
                every=every, align=draw(st.sampled_from([1, 16])), drop=draw(st.sampled_from([0.0, 0.3])),
                seed=draw(st.integers(0, 2**16)))


@given(cases())
def test_every_chunk_sees_exactly_its_snapshot(case):
    B, H, T, L, lag, sizes = case["B"], case["H"], case["T"], case["chunk"], case["lag"], case["sizes"]
    g = torch.Generator().manual_seed(case["seed"])
    n_chunks, rows = len(sizes), max(max(sizes), 1)
    routes = random_routes(B, H, T, L, lag, sizes, case["drop"], g)
    x = torch.randn(B, H, T, 5, generator=g, dtype=torch.float64)
    plan = plan_versioned(n_chunks, L, rows, lag, case["every"], case["align"])
    (snap,), counts = segment_snapshot_sums([x], routes, L, n_chunks, plan.rows, lag=lag)
    vs = versioned_sums([x], routes, plan)
    laid, laid_counts = vs.rows[0], vs.counts[..., None].double()
    assert vs.born.shape == vs.dies.shape == (B, H, plan.state_rows)
    dead = vs.dies <= vs.born  # rows no chunk sees (a version row entering at a checkpoint's chunk among them)
    assert not vs.born[dead].any() and not vs.dies[dead].any(), "a dead row's liveness is not born = dies = 0"
    n_ck_rows, pos = plan.n_ckpt * plan.rows, torch.arange(plan.n_versions)
    for c in range(n_chunks):
        # the liveness alone decides (the mask tests only it): a live row lies in chunk c's intervals,
        # checkpoint c // every's rows and the version rows of tokens entering in chunks (every * (c // every), c]
        k = c // plan.every
        entry = pos // L + lag
        inside = torch.cat([torch.arange(n_ck_rows) // plan.rows == k, (entry > k * plan.every) & (entry <= c)])
        alone = (vs.born <= c) & (c < vs.dies)
        assert not (alone & ~inside).any(), f"chunk {c}: a live row outside its intervals"
        # liveness order: of each checkpoint's rows and of each chunk's version rows, those live now are a prefix
        for group in (alone[..., :n_ck_rows].unflatten(-1, (plan.n_ckpt, plan.rows)),
                      alone[..., n_ck_rows:].unflatten(-1, (n_chunks, L))):
            assert (group[..., 1:] <= group[..., :-1]).all(), f"chunk {c}: a live row after a dead one of its group"
        state, seen = snapshot_from_versioned(laid, vs, plan, c)
        cnt, _ = snapshot_from_versioned(laid_counts, vs, plan, c)
        # each slot with tokens in the snapshot is seen exactly once, the others never
        assert torch.equal(seen, (counts[:, :, c] > 0).long()), f"chunk {c}: wrong rows live"
        torch.testing.assert_close(state, snap[:, :, c], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cnt[..., 0].float(), counts[:, :, c])
        # live rows are slots of the dictionary chunk c reads
        assert not seen[:, :, sizes[c]:].any()


def test_sums_are_differentiable_and_match_snapshot_gradients():
    g = torch.Generator().manual_seed(3)
    L, lag, sizes = 16, 1, [0, 5, 9, 9, 12, 12]
    routes = random_routes(1, 2, 90, L, lag, sizes, 0.1, g)
    x = torch.randn(1, 2, 90, 4, generator=g, dtype=torch.float64, requires_grad=True)
    plan = plan_versioned(len(sizes), L, 12, lag, every=2)
    vs = versioned_sums([x], routes, plan)
    laid = vs.rows[0]
    (snap,), _ = segment_snapshot_sums([x], routes, L, len(sizes), 12, lag=lag)
    w = torch.randn(len(sizes), 1, 2, 12, 4, generator=g, dtype=torch.float64)
    got = sum((snapshot_from_versioned(laid, vs, plan, c)[0] * w[c]).sum() for c in range(len(sizes)))
    want = sum((snap[:, :, c] * w[c]).sum() for c in range(len(sizes)))
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])


def test_long_sequence_keeps_fp32_accuracy():
    """fp64 segmented cumsum: a slot's sum late in a long fp32 sequence stays as accurate as the snapshot's."""
    g = torch.Generator().manual_seed(0)
    T, L = 8192, 128
    routes = torch.randint(0, 8, (1, 1, T), generator=g)
    x = 10 + torch.randn(1, 1, T, 8, generator=g)  # large common offset: a global running sum grows to ~8e5
    plan = plan_versioned(T // L, L, 8, 1, every=4)
    vs = versioned_sums([x], routes, plan)
    (ref,), _ = segment_snapshot_sums([x.double()], routes, L, T // L, 8, lag=1)
    n_ck_rows = plan.n_ckpt * 8
    last = vs.born[0, 0, n_ck_rows:] > 0
    # a version row lies among its token's chunk's rows: row t of the version rows is a token of chunk t // L
    slots, t = vs.slot[0, 0, n_ck_rows:][last], torch.nonzero(last).squeeze(1)
    want = ref[0, 0, (t // L + 1).clamp(max=T // L - 1), slots]
    ok = t // L + 1 < T // L
    err = ((vs.rows[0][0, 0, n_ck_rows:][last][ok].double() - want[ok]).abs() / want[ok].abs()).max().item()
    assert err < 1e-6, err


def test_plan_and_layout_choice():
    plan = plan_versioned(n_chunks=256, chunk_size=128, rows=1927, lag=1, align=128)
    assert (plan.rows, plan.every, plan.n_ckpt) == (2048, 8, 32)
    assert plan.state_rows == 32 * 2048 + 256 * 128 <= 3 * 256 * 128
    assert choose_state_layout("auto", n_chunks=256, rows=1927, plan=plan) == "versioned"
    small = plan_versioned(n_chunks=4, chunk_size=32, rows=40, lag=1)
    assert choose_state_layout("auto", n_chunks=4, rows=40, plan=small) == "snapshot"
    assert choose_state_layout("versioned", n_chunks=4, rows=40, plan=small) == "versioned"
    with pytest.raises(ValueError, match=r"state_layout must be one of \['auto', 'snapshot', 'versioned'\], "
                                         r"got 'sparse'"):
        choose_state_layout("sparse", n_chunks=4, rows=40, plan=small)
    # blocks of 128 rows over chunks of 16: the spacing (12 by rows per token) rounded up to whole blocks of
    # chunks, so a query block reads one checkpoint
    assert plan_versioned(n_chunks=64, chunk_size=16, rows=300, lag=1, align=128).every == 16
    assert default_every(384, 16, 64) == 12
    with pytest.raises(ValueError, match="routes cover T=129 tokens, more than the plan's 128"):
        versioned_sums([torch.zeros(1, 1, 129, 2)], torch.zeros(1, 1, 129, dtype=torch.long), small)


@pytest.mark.parametrize("device_type,grad,want", [("cpu", False, "snapshot"), ("cpu", True, "versioned"),
                                                   ("cuda", False, "snapshot"), ("cuda", True, "versioned"),
                                                   ("meta", False, "versioned")],
                         ids=["cpu-no-grad", "cpu-grad", "cuda-no-grad", "cuda-grad", "unmeasured-device"])
def test_auto_weighs_rows_by_the_device_cost_without_gradients(device_type, grad, want):
    """VQ at 4k (codebook 512, lag 2): the snapshot has 4/3 the versioned rows. A versioned row costs
    LAYOUT_ROW_COST["cpu"] = 2 snapshot rows on the CPU (5.25 on CUDA), so its forward keeps snapshots;
    with gradients, or on a device type without a measured cost, fewer rows win."""
    plan = plan_versioned(n_chunks=32, chunk_size=128, rows=512, lag=2, align=128)
    assert 32 * 512 == plan.state_rows * 4 / 3 and LAYOUT_ROW_COST["cpu"] == (2, 1)
    assert choose_state_layout("auto", n_chunks=32, rows=512, plan=plan, device_type=device_type, grad=grad) == want
    big = plan_versioned(n_chunks=256, chunk_size=128, rows=1927, lag=1, align=128)  # OVQ at 32k: 5x fewer rows
    assert choose_state_layout("auto", n_chunks=256, rows=1927, plan=big, device_type=device_type,
                               grad=grad) == ("snapshot" if (device_type, grad) == ("cuda", False) else "versioned")
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1, got 0"):
        plan_versioned(4, 32, 40, 1, every=0)


@pytest.mark.parametrize("rows, chunk, n_chunks", [(2048, 128, 512), (2048, 128, 33), (4096, 128, 512),
                                                   (512, 128, 32), (40, 16, 7), (1000, 32, 250), (64, 64, 1)],
                         ids=["ovq-64k", "ovq-4k-ragged", "kvm-64k", "vq-4k", "tiny", "odd", "one-chunk"])
@pytest.mark.parametrize("per_token", [1, 2, 3])
def test_default_spacing_is_the_smallest_within_its_rows_per_token(rows, chunk, n_chunks, per_token):
    """R >= ceil(rows / (per_token L)), and the smallest such R whose whole checkpoint intervals hold at most
    per_token T rows (T = n_chunks L), unless R reaches n_chunks (one checkpoint)."""
    every = default_every(rows, chunk, n_chunks, per_token)
    low = -(-rows // (per_token * chunk))
    fits = lambda r: r >= n_chunks or n_chunks // r * rows <= per_token * n_chunks * chunk  # noqa: E731
    assert every >= low and fits(every)
    assert every == low or not fits(every - 1)


def test_memory_spacing_holds_a_quarter_fewer_rows_at_64k():
    """OVQ at 64k (N = 2,048, chunk 128): 2 checkpoint rows per token space checkpoints every 8 chunks (64 of
    them, 131,072 rows, plus 65,536 version rows); 1 row per token every 16 chunks (32: 65,536 + 65,536), so the
    kv rows with the 65,536 token rows fall from 262,144 to 196,608."""
    speed = plan_versioned(n_chunks=512, chunk_size=128, rows=2048, lag=1, align=128)
    memory = plan_versioned(n_chunks=512, chunk_size=128, rows=2048, lag=1, align=128, per_token=1)
    assert (speed.every, speed.n_ckpt, speed.state_rows) == (8, 64, 196608)
    assert (memory.every, memory.n_ckpt, memory.state_rows) == (16, 32, 131072)
    with pytest.raises(ValueError, match="per_token must be >= 1, got 0"):
        plan_versioned(512, 128, 2048, 1, per_token=0)


def test_memory_decides_with_gradients_or_past_the_snapshot_bound():
    assert memory_decides(32, 2048, grad=True)
    assert not memory_decides(32, 2048, row_bytes=1024)  # 64 MiB of snapshot state
    assert memory_decides(32, 2048, row_bytes=SNAPSHOT_MAX_BYTES // (32 * 2048) + 1)


def test_auto_weighs_rows_alone_once_the_snapshot_state_passes_its_byte_bound():
    """OVQ at 64k (the H200 stages run's rows): B=1, H=8, D=64 in bf16 (2,048 bytes a state row: 1.9 GiB of
    snapshot keys and values) keeps its faster snapshot on CUDA; a batch of 16 with H=4 in fp32 (32 KiB a
    row: 31 GiB), the decode bench's prefill that ran out of memory on an 80 GB H100, is versioned."""
    plan = types.SimpleNamespace(state_rows=196608)
    assert SNAPSHOT_MAX_BYTES == 4 * 2**30
    layout = functools.partial(choose_state_layout, "auto", n_chunks=1, rows=1016320, plan=plan, device_type="cuda")
    assert layout(row_bytes=1 * 8 * (64 + 64) * 2) == "snapshot"
    assert layout(row_bytes=16 * 4 * (64 + 64) * 4) == "versioned"
    assert layout() == "snapshot"  # 0: bytes not weighed


# The 2-core CPU (torch 2.13, fp32, B=1, H=2, D=64, blocked backend; `ovqflex bench profiles/memory.toml`, run on
# 2026-12-03 at 33ad39b): state rows and block-list widths of each layout, and what the forward+backward kept for its
# backward (`saved_mb`). OVQ N = 2,048 (chunk 128, and the tiny preset's chunk 16 with blocks of 32), KVM power-law
# 16 sqrt(ctx), VQ N = 512.
# (case, T): (snapshot rows, versioned rows, snapshot width, versioned width, snapshot MB kept, versioned MB kept)
CPU_BLOCKED = {
    ("ovq", 4096): (43264, 12544, 13, 17, 173.5, 232.4), ("ovq", 8192): (104576, 24832, 15, 20, 397.3, 543.0),
    ("ovq", 16384): (232704, 47104, 17, 23, 894.9, 1242), ("ovq", 32768): (493312, 98304, 18, 24, 1890, 2589),
    ("ovq-tiny", 512): (12768, 1760, 27, 20, 22.16, 17.07), ("ovq-tiny", 1024): (43200, 3136, 45, 29, 72.15, 48.25),
    ("ovq-tiny", 2048): (130432, 6144, 66, 45, 209.3, 146.8), ("kvm", 4096): (32256, 12288, 11, 13, 198.6, 201.0),
    ("kvm", 16384): (260992, 49152, 19, 25, 1394, 1429), ("vq", 4096): (16384, 12288, 6, 7, 87.89, 104.4),
    ("vq", 16384): (65536, 49152, 6, 7, 350.8, 416.8)}


@pytest.mark.parametrize("case", list(CPU_BLOCKED), ids=[f"{m}-{t // 1024}k" if t >= 1024 else f"{m}-{t}"
                                                        for m, t in CPU_BLOCKED])
def test_blocked_training_takes_the_layout_that_kept_less_on_the_cpu(case):
    """With gradients on the blocked backend (``widths`` given) ``auto`` takes the layout whose backward kept
    less in the CPU run, in every case, by the narrower block lists; by rows (what flex keeps) it would take
    the versioned state, fewer rows in each case, which kept more in 8 of these 11."""
    snap_rows, ver_rows, snap_w, ver_w, snap_mb, ver_mb = CPU_BLOCKED[case]
    plan = types.SimpleNamespace(state_rows=ver_rows)
    kept_less = "snapshot" if snap_mb < ver_mb else "versioned"
    layout = functools.partial(choose_state_layout, "auto", n_chunks=1, rows=snap_rows, plan=plan, device_type="cpu")
    assert layout(grad=True, widths=(snap_w, ver_w)) == kept_less
    assert layout(grad=True) == "versioned"


def test_blocked_widths_weigh_only_gradients_with_a_snapshot_within_its_bound():
    """Widths decide only with gradients, when they differ and the snapshot state is within SNAPSHOT_MAX_BYTES;
    otherwise rows (and without gradients, the device's row cost) decide as before."""
    plan = types.SimpleNamespace(state_rows=12544)
    layout = functools.partial(choose_state_layout, "auto", n_chunks=1, rows=43264, plan=plan, device_type="cpu")
    assert layout(grad=True, widths=(13, 17)) == "snapshot"
    assert layout(grad=True, widths=(17, 17)) == "versioned"  # a tie: fewer rows
    assert layout(grad=True, widths=(17, 17), plan=types.SimpleNamespace(state_rows=43265)) == "snapshot"
    assert layout(grad=True, widths=(13, 17), row_bytes=SNAPSHOT_MAX_BYTES // 43264 + 1) == "versioned"
    assert layout(grad=False, widths=(13, 17)) == "versioned"  # 2 x 12,544 < 43,264 (LAYOUT_ROW_COST["cpu"])
    assert choose_state_layout("versioned", n_chunks=1, rows=43264, plan=plan, grad=True, widths=(13, 17)) == \
        "versioned"


# One H200 (torch 2.11, bf16, B=1, H=8, D=64, chunk 128; `ovqflex bench profiles/gpu.toml --device cuda
# --only stages`): state rows of each layout and the measured forward (program build + flex kernel), ms.
H200_STAGES = {  # (method, T): (snapshot rows, versioned rows, snapshot ms, versioned ms)
    ("ovq", 4096): (43264, 12544, 3.87, 7.09), ("ovq", 16384): (232704, 47104, 9.14, 10.96),
    ("ovq", 65536): (1016320, 196608, 30.95, 32.21), ("kvm", 4096): (32256, 12288, 4.89, 7.26),
    ("kvm", 16384): (260992, 49152, 19.59, 18.47), ("kvm", 65536): (2094592, 196608, 122.28, 91.14),
    ("vq", 4096): (16384, 12288, 3.10, 9.83), ("vq", 16384): (65536, 49152, 3.67, 7.83),
    ("vq", 65536): (262144, 196608, 8.72, 15.71)}


@pytest.mark.parametrize("case", list(H200_STAGES), ids=[f"{m}-{t // 1024}k" for m, t in H200_STAGES])
def test_cuda_row_cost_chooses_the_layout_measured_faster_on_the_h200(case):
    """LAYOUT_ROW_COST["cuda"] picks, without gradients, the layout whose forward was faster on the H200."""
    snapshot_rows, versioned_rows, snapshot_ms, versioned_ms = H200_STAGES[case]
    plan = types.SimpleNamespace(state_rows=versioned_rows)
    faster = "snapshot" if snapshot_ms < versioned_ms else "versioned"
    assert choose_state_layout("auto", n_chunks=1, rows=snapshot_rows, plan=plan, device_type="cuda") == faster


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-inf"])
def test_version_sums_in_column_groups_equal_one_group_bit_for_bit(monkeypatch, dtype, nonfinite):
    """The fp64 cumsum runs ``FP64_COLUMNS`` columns at a time (memory): version rows and gradients
    equal one group over all columns bit for bit, a non-finite token marking its slot's rows in every
    column (D = 11 in groups of 4: 4, 4, 3)."""
    from recurrences import versioned

    g = torch.Generator().manual_seed(5)
    B, H, T, L, lag, D = 2, 2, 150, 16, 1, 11
    sizes = [0] + [min(12, 4 * c) for c in range(1, 10)]
    routes = random_routes(B, H, T, L, lag, sizes, 0.2, g)
    x = torch.randn(B, H, T, D, generator=g).to(dtype)
    if nonfinite:
        x[0, 1, 40, 3], x[1, 0, 70, 9] = float("nan"), float("inf")
    w = torch.randn(B, H, T + 64, D, generator=g)  # weights of the version rows in the loss
    plan = plan_versioned(len(sizes), L, 12, lag)
    results = []
    for columns in (64, 4):
        monkeypatch.setattr(versioned, "FP64_COLUMNS", columns)
        leaf = x.clone().requires_grad_()
        ver = versioned_sums([leaf], routes, plan).rows[0][:, :, plan.n_ckpt * plan.rows:]  # the version rows
        grad, = torch.autograd.grad((ver.float().nan_to_num(0.0, 0.0, 0.0) * w[:, :, :ver.shape[2]]).sum(), leaf)
        results.append((ver, grad))
    (ver1, grad1), (ver4, grad4) = results
    assert torch.equal(ver1.isnan(), ver4.isnan()) and bool(ver1.isnan().any()) == nonfinite
    assert torch.equal(ver1.nan_to_num(), ver4.nan_to_num()) and torch.equal(grad1, grad4)


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "with-inf"])
def test_the_version_sums_keep_no_float_intermediate_for_the_backward(finite):
    """What autograd keeps of ``versioned_sums`` until the backward is integer indices alone: gathering
    the fp64 running sums (and the sums back into token order) kept a ``[B, H, T, 16]`` fp64 copy per
    column block and a ``[B, H, T, D]`` one per tensor; so did the finiteness masks of the non-finite path
    (the CUDA and compiled path), through ``isfinite``'s ``abs``; and the checkpoints' ``index_add`` kept
    the tensor itself (recurrences/segments.py)."""
    g = torch.Generator().manual_seed(4)
    L, lag, sizes = 16, 1, [0, 5, 9, 9, 12, 12]
    routes = random_routes(1, 2, 96, L, lag, sizes, 0.1, g)
    x = torch.randn(1, 2, 96, 40, generator=g)  # 40 columns: three fp64 blocks
    if not finite:
        x[0, 1, 50, 3] = float("inf")
    x.requires_grad_()
    plan = plan_versioned(len(sizes), L, 12, lag, every=2)
    assert plan.n_versions == 96  # no padding copy of x
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        vs = versioned_sums([x], routes, plan)
    assert saved and not [tuple(t.shape) for t in saved if t.is_floating_point()]
    # nor a mask of the summed entries (``where``'s backward kept the finiteness mask, a byte an entry): at most
    # one flag a token (the slot's rows marked non-finite)
    per_token = x.numel() // x.shape[-1]
    assert not [tuple(t.shape) for t in saved if t.dtype == torch.bool and t.numel() > per_token]
    assert vs.rows[0].requires_grad


@pytest.mark.parametrize("bad", ["nan", "inf", "nan-and-inf"])
def test_a_non_finite_token_gets_the_gradient_of_its_finite_rows_alone(bad):
    """With non-finite tokens (the marked path), the gradient of the state rows' finite entries is the one
    of the finite run that sums those entries as 0 and drops the rows that came out non-finite from the loss:
    a finite token's gradient as before, the non-finite entries' zero (up to the cumsum's rounding, fp64)."""
    g = torch.Generator().manual_seed(8)
    L, lag, sizes = 16, 1, [0, 5, 9, 9, 12, 12]
    routes = random_routes(2, 2, 96, L, lag, sizes, 0.1, g)
    x = torch.randn(2, 2, 96, 6, generator=g, dtype=torch.float64)
    if "nan" in bad:
        x[0, 1, 20, 3] = float("nan")
    if "inf" in bad:
        x[1, 0, 33, 0] = float("inf")
    plan = plan_versioned(len(sizes), L, 12, lag, every=2)
    w = torch.randn(2, 2, plan.state_rows, 6, generator=g, dtype=torch.float64)

    def grad(x, w):
        leaf = x.clone().requires_grad_()
        rows = versioned_sums([leaf], routes, plan).rows[0]
        (got,) = torch.autograd.grad((rows.nan_to_num(0.0, 0.0, 0.0) * w).sum(), leaf)
        return rows.detach(), got

    rows, got = grad(x, w)
    finite_rows = torch.isfinite(rows)
    assert not finite_rows.all()
    _, want = grad(x.nan_to_num(0.0, 0.0, 0.0), torch.where(finite_rows, w, 0.0))  # every token finite
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-12
    assert float(got[~torch.isfinite(x)].abs().max()) < 1e-12 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_version_sums_gradient_is_the_eager_one_with_a_non_finite_token(dtype):
    """Compiled (the marked path, as on CUDA), the version sums' gradient is the eager one: the summed tokens
    pass through :class:`recurrences.versioned._ZeroedNonFinite` and the column blocks' fp64 cumsums."""
    g = torch.Generator().manual_seed(9)
    L, lag, sizes = 16, 1, [0, 5, 9, 9, 12, 12]
    routes = random_routes(1, 2, 96, L, lag, sizes, 0.1, g)
    x = torch.randn(1, 2, 96, 20, generator=g).to(dtype)
    x[0, 1, 40, 3] = float("inf")
    plan = plan_versioned(len(sizes), L, 12, lag, every=2)
    w = torch.randn(1, 2, plan.state_rows, 20, generator=g).to(dtype)

    def loss(x):
        return (versioned_sums([x], routes, plan).rows[0].nan_to_num(0.0, 0.0, 0.0) * w).float().sum()

    torch._dynamo.reset()
    leaf = x.clone().requires_grad_()
    (eager,) = torch.autograd.grad(loss(leaf), leaf)
    (compiled,) = torch.autograd.grad(torch.compile(loss, fullgraph=True)(leaf), leaf)
    assert bool(eager.abs().max() > 0) and torch.isfinite(compiled).all()
    assert rel_err(compiled.float(), eager.float()) < 1e-6


HEAVY_CHUNK, HEAVY_ROWS = 128, 8  # the chunk size and state rows of heavy_bf16_case's routes


def heavy_bf16_case(device) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 tokens ``x [1, 2, 4096, 16]`` and routes ``[1, 2, 4096]`` (chunks of HEAVY_CHUNK = 128,
    HEAVY_ROWS = 8 rows) that stress bf16 sums: 90% of the tokens go to one row and all are ~3 (same
    sign), so a chunk adds ~115 tokens to that row's cell and its running sum reaches ~11,000, where
    bf16's spacing is 64: a bf16 accumulator would stop growing at 2,048 (one such sum of 4,000 tokens:
    2,048 against 11,974)."""
    g = torch.Generator().manual_seed(11)
    B, H, T, D = 1, 2, 4096, 16
    x = (3 + torch.randn(B, H, T, D, generator=g)).bfloat16().to(device)
    heavy = torch.rand(B, H, T, generator=g) < 0.9
    routes = torch.where(heavy, 0, torch.randint(0, HEAVY_ROWS, (B, H, T), generator=g)).to(device)
    return x, routes


def layout_sums(layout: str, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """Every state sum of x by routes (:func:`heavy_bf16_case`'s chunks and rows), flat: ``"snapshot"`` the
    snapshots (:func:`segment_snapshot_sums`), ``"versioned"`` :func:`versioned_sums`' checkpoints and
    version rows."""
    L, rows, T = HEAVY_CHUNK, HEAVY_ROWS, x.shape[2]
    if layout == "snapshot":
        (s,), _ = segment_snapshot_sums([x], routes, L, T // L, rows)
        return s.flatten()
    vs = versioned_sums([x], routes, plan_versioned(T // L, L, rows, 1))
    return vs.rows[0].flatten()


def bf16_state_sums_error(layout: str, device) -> float:
    """The relative error of ``layout``'s bf16 state sums of :func:`heavy_bf16_case` on ``device``, in
    units of one rounding's (that of the fp32 sums of the same tokens rounded to bf16 once)."""
    x, routes = heavy_bf16_case(device)
    low, exact = layout_sums(layout, x, routes).float(), layout_sums(layout, x.float(), routes)
    return rel_err(low, exact) / rel_err(exact.bfloat16().float(), exact)


def bf16_state_sums_round_about_once(layout: str, device) -> None:
    """The dtype rule for state sums (recurrences/precision.py, rule 3) on ``device``: the sums are kept in
    bf16, so in ``layout`` they are within twice the relative error of rounding once the fp32 sums of the
    same tokens (:func:`heavy_bf16_case`). The CPU's scatter and scan accumulate in fp32; CUDA's
    ``index_add_`` and scan add bf16 in bf16, rounding every add, so there a cell's tokens are summed in
    fp32 first and the scan runs in fp32 (``NARROW_ADDS``, ``NARROW_SCANS``;
    :func:`test_narrow_adds_as_on_cuda_are_summed_in_fp32` emulates that device on the CPU)."""
    err = bf16_state_sums_error(layout, device)
    assert err <= 2, f"bf16 state sums: {err:.2f} times one rounding's relative error"


def emulate_narrow_adds(monkeypatch) -> None:
    """Make the CPU's bf16/fp16 ``Tensor.index_add_`` and ``Tensor.cumsum`` add as CUDA's do, in the
    tensor's dtype, rounding every add (the index_add's adds in token order; other dtypes unchanged)."""
    index_add_, cumsum = torch.Tensor.index_add_, torch.Tensor.cumsum
    half = (torch.bfloat16, torch.float16)

    def narrow_index_add_(self, dim, index, source, **kw):
        if self.dtype not in half or kw or dim != 0:
            return index_add_(self, dim, index, source, **kw)
        order = torch.sort(index, stable=True).indices
        rank = torch.arange(len(index)) - torch.searchsorted(index[order], index[order])  # place within its cell
        for k in range(int(rank.max()) + 1 if len(index) else 0):
            tok = order[rank == k]
            self[index[tok]] = (self[index[tok]].float() + source[tok].float()).to(self.dtype)
        return self

    def narrow_cumsum(self, dim, **kw):
        if self.dtype not in half or kw:
            return cumsum(self, dim, **kw)
        out, acc = torch.empty_like(self), torch.zeros_like(self.select(dim, 0))
        for i in range(self.shape[dim]):
            acc = (acc.float() + self.select(dim, i).float()).to(self.dtype)
            out.select(dim, i).copy_(acc)
        return out

    monkeypatch.setattr(torch.Tensor, "index_add_", narrow_index_add_)
    monkeypatch.setattr(torch.Tensor, "cumsum", narrow_cumsum)


@pytest.mark.parametrize("layout", ["snapshot", "versioned"])
def test_bf16_state_sums_are_rounded_about_once(layout):
    """On the CPU (1.00-1.04x one rounding's error here); the cuda tier runs the same check on CUDA."""
    bf16_state_sums_round_about_once(layout, "cpu")


@pytest.mark.parametrize("layout", ["snapshot", "versioned"])
def test_bf16_state_sums_summed_as_on_cuda_equal_the_cpus(layout, monkeypatch):
    """CUDA's way with bf16 state sums (each cell's tokens in fp32 first, the scans in fp32;
    tests.helpers.sum_narrow_as_on_cuda) taken on the CPU: the sums and their gradients are the CPU's own
    to a bf16 rounding (both round fp32 sums once)."""
    x, routes = heavy_bf16_case("cpu")
    w = torch.randn(layout_sums(layout, x, routes).shape, generator=torch.Generator().manual_seed(1))

    def sums_and_grad():
        xg = x.clone().requires_grad_()
        s = layout_sums(layout, xg, routes)
        (s.float() * w).sum().backward()
        return s.float(), xg.grad.float()

    cpu_sums, cpu_grad = sums_and_grad()
    sum_narrow_as_on_cuda(monkeypatch)
    cuda_sums, cuda_grad = sums_and_grad()
    assert rel_err(cuda_sums, cpu_sums) <= 2 ** -8 and rel_err(cuda_grad, cpu_grad) <= 2 ** -8


@pytest.mark.parametrize("layout", ["snapshot", "versioned"])
def test_narrow_adds_as_on_cuda_are_summed_in_fp32(layout, monkeypatch):
    """CUDA's adds emulated on the CPU (:func:`emulate_narrow_adds`): the CPU's own way with them breaks
    the rule in the snapshot layout, whose sums are all scans over chunks; CUDA's (each cell's tokens in
    fp32 first, the scans in fp32) keeps every sum within about one rounding."""
    emulate_narrow_adds(monkeypatch)
    with torch.no_grad():
        narrow = bf16_state_sums_error(layout, "cpu")
        sum_narrow_as_on_cuda(monkeypatch)
        wide = bf16_state_sums_error(layout, "cpu")
    assert wide <= 1.1 and (layout != "snapshot" or narrow > 2), f"{narrow:.2f} -> {wide:.2f} times one rounding"
