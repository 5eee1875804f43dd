"""Static (in-place) decode caches == the functional caches (docs/design.md §6, "Static decode").

A static step reads every slot of fixed buffers, masking the empty or dead ones, where the
functional step reads only the kept tokens and live rows: the softmax sums more (masked, zero)
terms in another order, so outputs agree to fp32 rounding, not bit for bit (``STATIC_TOL``,
relative). What both paths compute with the same kernels is compared exactly: OVQ's routes, hence
its counts, and (eager) its dictionary sums, which go through the same ``ovq_absorb``. Compiled,
inductor's own ``F.normalize`` rounds the unit keys differently, so the sums agree to rounding.
KVM's first absorb is the functional one, every later one the static routing step on the ring's
slots of the chunk, whose routes and state are the loop's (tests/recurrences/test_kvm_routing_static.py):
its state, counts and sums are equal bit for bit, and compiled equal to the eager step's. VQ's
absorb is the functional one on the ring's slots of the chunk: its counts and sums are equal bit for
bit. A recurrence's static step is the functional step's op on the same state: outputs and states
are equal bit for bit.
"""
import dataclasses

import pytest
import torch

import ovqflex
from masks.regions import BlockWindow, Causal, Sinks, StateBank, TokenWindow
from ovqflex.cache.kvm import StaticKVMCache
from ovqflex.cache.ovq import StaticOVQCache
from ovqflex.cache.plain import StaticPlainCache
from ovqflex.cache.recurrent import StaticRecurrentCache
from ovqflex.cache.vq import StaticVQCache
from ovqflex.layers.vq import VQInputs
from ovqflex.ops.plain_decode import static_slots
from tests.helpers import assert_close

HIDDEN, HEADS = 32, 2
STATIC_TOL = 1e-6  # fp32: the functional and the static softmax sum the same terms in another order

LAYERS = {
    "swa-7-conv": lambda: _conv(ovqflex.SlidingWindowAttention(HIDDEN, HEADS, window=7, qk_conv=3, backend="dense")),
    "swa-5-sinks": lambda: ovqflex.SlidingWindowAttention(HIDDEN, HEADS, window=5, n_sinks=2, backend="dense"),
    "bswa-2x16": lambda: ovqflex.SlidingWindowAttention(HIDDEN, HEADS, block_window=2, chunk_size=16,
                                                        backend="dense"),
    "full-rope-qknorm-logn12": lambda: ovqflex.CausalAttention(HIDDEN, HEADS, rope=True, qk_norm=True, logn_len=12,
                                                               backend="dense"),
    "ovq-plateau": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=24, backend="dense"),
    "ovq-full-norm-conv": lambda: _conv(ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=40,
                                                             growth="full", normalize_centroids=True, qk_conv=2,
                                                             backend="dense")),
    "ovq-linear": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=30, growth="linear",
                                               growth_horizon=64, backend="dense"),
    "kvm-fixed": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=16, backend="dense"),
    "kvm-powerlaw-uncapped-conv": lambda: _conv(ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=16, budget="power_law",
                                                                     max_state_chunks=None, qk_conv=2,
                                                                     backend="dense")),
    "kvm-nb3-cap2-means": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=16, n_bswa_chunks=3,
                                                       max_state_chunks=2, use_vlens=False, ln_eps=1e-2,
                                                       backend="dense"),
    "vq-conv": lambda: _conv(ovqflex.VQAttention(HIDDEN, HEADS, codebook_size=24, chunk_size=16, qk_conv=2,
                                                 backend="dense")),
    "vq-diveq-localbias": lambda: _local_bias(ovqflex.VQAttention(HIDDEN, HEADS, codebook_size=24, chunk_size=16,
                                                                 estimator="diveq", local_bias=True, backend="dense")),
    "longvq": lambda: _local_bias(ovqflex.LongVQBlock(HIDDEN, HEADS, codebook_size=24, chunk_size=16,
                                                      backend="dense")),
    "linear-conv": lambda: _conv(ovqflex.LinearAttention(HIDDEN, HEADS, qk_conv=3)),
    "deltanet-outnorm": lambda: ovqflex.DeltaNetAttention(HIDDEN, HEADS, out_norm=True),
    "vla-refresh4-conv": lambda: _conv(ovqflex.VLAAttention(HIDDEN, HEADS, refresh_every=4, qk_conv=2)),
}


def _conv(layer):
    """``layer`` with its q/k convolution moved off the identity it starts as (last tap 1, the others 0), so
    that the conv tail a cache carries changes the outputs."""
    with torch.no_grad():
        layer.qk_conv_weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    return layer


def _local_bias(layer):
    """``layer`` with a non-zero local bias (its init is 0, which the static step's fold would not test)
    and, with the DiVeQ estimator, non-zero idle steps (the codes' assignment bonus)."""
    with torch.no_grad():
        layer.local_bias.copy_(torch.linspace(-1.0, 1.5, layer.num_heads))
        if layer.quantizer.estimator == "diveq":
            layer.quantizer.idle_steps.copy_(torch.arange(layer.quantizer.idle_steps.numel()).view_as(
                layer.quantizer.idle_steps) % 7 * 40.0)
    return layer


def _decode_both(layer, x: torch.Tensor, split: int, step=None, compile_boundary: bool = False,
                 boundary_autocast: bool = False):
    """Prefill ``x[:, :split]``, then decode the rest one token per call functionally and through a
    static cache (``step``: the callable that runs the layer on it) -> (functional ys, static ys,
    functional cache, static cache). Every step and boundary writes the static cache's buffers in
    place (the same storage, shape and dtype throughout: what a CUDA graph of the step relies on).
    ``boundary_autocast``: the boundaries run inside bf16 autocast (as under a caller's autocast region)."""
    step = layer if step is None else step
    boundary_context = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=boundary_autocast)  # noqa: E731
    with torch.no_grad():
        _, cache = layer(x[:, :split], use_cache=True)
        static = layer.static_cache(cache, x.shape[1])
        buffers = _buffers(static)
        yf, ys = [], []
        for t in range(split, x.shape[1]):
            y, cache = layer(x[:, t:t + 1], cache=cache)
            yf.append(y)
            y, same = step(x[:, t:t + 1], cache=static)
            assert same is static
            ys.append(y)
            with boundary_context():
                layer.static_boundary(static, t + 1, compile=compile_boundary)
            assert _buffers(static) == buffers, f"step {t}: a static cache buffer was replaced"
    return torch.cat(yf, 1), torch.cat(ys, 1), cache, static


def _buffers(static) -> list[tuple]:
    """Each field of a static cache: (name, storage address, shape, dtype) of a tensor, else its value."""
    return [(f.name, *((v.data_ptr(), v.shape, v.dtype) if isinstance(v, torch.Tensor) else (v,)))
            for f in dataclasses.fields(static) for v in [getattr(static, f.name)]]


def _dictionaries_agree(cache, static, exact: bool) -> None:
    live = static.counts.shape[2] - 1  # every row the capacity reaches (the functional cache may hold more)
    assert torch.equal(cache.counts[:, :, :live], static.counts[:, :, :live])  # the same routes
    for f, s in ((cache.key_sums, static.key_sums), (cache.value_sums, static.value_sums)):
        if exact:
            assert torch.equal(f[:, :, :live], s[:, :, :live])
        else:
            assert_close(s[:, :, :live], f[:, :, :live], STATIC_TOL)


@pytest.mark.parametrize("split", [5, 16, 37, 64])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_static_decode_equals_functional_decode(name, split):
    """Many steps after prefills of several lengths (before, at and after a chunk end), B = 3:
    window rings wrap several times, OVQ crosses chunk ends (with ``split=5`` the first seeding
    happens in the static cache), KVM founds its state and absorbs chunks (``split=64``: the
    static cache is made just before a chunk's absorb)."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    x = torch.randn(3, 120, HIDDEN)
    yf, ys, cache, static = _decode_both(layer, x, split)
    _static_agrees(name, yf, ys, cache, static, x.shape[1])


@pytest.mark.parametrize("name", [n for n in sorted(LAYERS) if n.startswith(("ovq", "kvm", "vq", "longvq"))])
def test_a_static_boundary_routes_the_same_under_autocast(name):
    """A boundary run inside bf16 autocast (``generate`` under the caller's autocast region) routes and
    absorbs as without it: the functional decode's routes (autocast off inside its routing), its states
    bit for bit. KVM's static step had multiplied its fp32 keys and rows in bf16 there."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    x = torch.randn(3, 120, HIDDEN)
    yf, ys, cache, static = _decode_both(layer, x, 37, boundary_autocast=True)
    _static_agrees(name, yf, ys, cache, static, x.shape[1])


def _static_agrees(name, yf, ys, cache, static, T: int) -> None:
    """After ``T`` tokens, the static decode's outputs ``ys`` are the functional ``yf`` (``STATIC_TOL``) and
    its cache holds the functional cache's state: what both compute with the same kernels bit for bit
    (module docstring)."""
    assert_close(ys, yf, STATIC_TOL, name)
    assert int(static.position) == cache.position == T
    assert (cache.conv is None and static.conv is None) or torch.equal(cache.conv, static.conv)
    if isinstance(static, StaticOVQCache):
        _dictionaries_agree(cache, static, exact=True)
    elif isinstance(static, StaticKVMCache):
        r = cache.rows
        for f in ("state", "value_sums", "radius", "counts"):
            assert torch.equal(getattr(cache, f)[:, :, :r], getattr(static, f)[:, :, :r]), f
    elif isinstance(static, StaticVQCache):
        for f in ("counts", "value_sums") + (("ema",) if hasattr(static, "ema") else ()):
            assert torch.equal(getattr(cache, f), getattr(static, f)), f
    elif isinstance(static, StaticRecurrentCache):
        assert torch.equal(ys, yf)
        state, buffers = cache.tensors(), static.tensors()[1:]  # (the static cache's first: its position)
        assert len(state) == len(buffers) and all(torch.equal(f, s) for f, s in zip(state, buffers))
    else:
        assert isinstance(static, StaticPlainCache)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_static_decode_fills_its_capacity_at_a_chunk_end(name):
    """A capacity that ends a chunk (64 tokens, chunks of 16): the boundary after the last step
    finds the cache full and prepares no next chunk (KVM's lookup of that chunk's rows once fell
    off the end of its table here); the outputs still equal the functional decode's."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    x = torch.randn(2, 64, HIDDEN)
    yf, ys, cache, static = _decode_both(layer, x, 37)
    assert_close(ys, yf, STATIC_TOL, name)
    assert int(static.position) == cache.position == 64


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_step_past_the_capacity_is_refused_at_its_boundary(name):
    """Every static cache holds ``capacity`` tokens: steps up to it pass their boundary, and the boundary after
    a step past it is refused by name (full attention's ring had overwritten its oldest token: outputs off by
    0.017 and 0.046 after two such steps, silently). A model's boundary checks each of its layers."""
    torch.manual_seed(0)
    layer = LAYERS[name]().eval()
    x = torch.randn(1, 23, HIDDEN)
    with torch.no_grad():
        _, cache = layer(x[:, :20], use_cache=True)
        static = layer.static_cache(cache, 22)
        for t in (20, 21):
            layer(x[:, t:t + 1], cache=static)
            layer.static_boundary(static, t + 1)
        layer(x[:, 22:23], cache=static)
        with pytest.raises(ValueError, match="a static decode cache of capacity 22 was stepped to position 23"):
            layer.static_boundary(static, 23)


def test_a_models_boundary_refuses_a_step_past_the_capacity():
    from ovqflex.models import HybridLM, preset

    model = HybridLM(preset("tiny", vocab_size=32, d_model=32, block_size=16, backend="blocked")).eval()
    tokens = torch.randint(0, 32, (1, 12))
    with torch.no_grad():
        _, cache = model(tokens[:, :10], use_cache=True)
        caches = model.static_caches(cache, 11)
        model.decode_static(tokens[:, 10:11], caches)
        model.static_boundary(caches, 11)
        model.decode_static(tokens[:, 11:12], caches)
        with pytest.raises(ValueError, match="capacity 11 was stepped to position 12"):
            model.static_boundary(caches, 12)


def _poison_values(layer, value: float, at: dict[int, int]) -> None:
    """Make ``layer`` write ``value`` into the values of head 1 of batch ``b`` at position ``t``
    for each ``t: b`` of ``at`` (whether that token is in a prefill or a decode step)."""
    project = layer._project

    def poisoned(x, cache, use_cache=False):
        inputs = project(x, cache, use_cache)  # q, k, v, ... or a VQ layer's VQInputs
        v = (inputs.v if isinstance(inputs, VQInputs) else inputs[2]).clone()
        start = 0 if cache is None else int(cache.position)
        for t, b in at.items():
            if start <= t < start + v.shape[2]:
                v[b, 1, t - start] = value
        if isinstance(inputs, VQInputs):
            return dataclasses.replace(inputs, v=v)
        return *inputs[:2], v, *inputs[3:]

    layer._project = poisoned


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["swa-7-conv", "swa-5-sinks", "bswa-2x16", "full-rope-qknorm-logn12", "ovq-plateau",
                                  "kvm-fixed", "vq-conv", "longvq"])
def test_a_non_finite_value_reaches_the_same_queries_through_a_static_cache(name, value):
    """The non-finite rule (``ovqflex.attention``) on the static path, whose plain, OVQ and VQ caches
    store each value row's flag once: a NaN/inf value written by the prefill (batch 1 at position
    10, in a chunk the prefill completed; batch 2 at 18, in the chunk still open when the static cache
    is made at 21) and by a decode step (batch 0, position 40) makes exactly the functional decode's
    outputs NaN, and the others equal; a window's queries past the poisoned token are finite again,
    while full attention's and a compressed state's (which absorbed it) stay NaN."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    _poison_values(layer, value, {10: 1, 18: 2, 40: 0})
    x = torch.randn(4, 96, HIDDEN)
    split = 21
    yf, ys, _, _ = _decode_both(layer, x, split)
    bad = yf.isnan().any(-1)  # [B, T - split]: outputs mix the heads, so a NaN head fills the row
    assert torch.equal(ys.isnan().any(-1), bad)
    assert bad[0, 40 - split] and bad[2, 0] and not bad[3].any()
    assert_close(ys[~bad], yf[~bad], STATIC_TOL, name)
    if "swa" in name:  # the token and block windows
        assert not bad[:, -1].any(), "past the window every query is finite again"
    else:
        assert bad[:3, 40 - split:].all(), "every later query sees them"


@pytest.mark.parametrize("name", ["swa-5-sinks", "ovq-full-norm-conv", "kvm-powerlaw-uncapped-conv", "longvq",
                                  "vla-refresh4-conv"])
def test_static_step_compiles_once(name):
    """``torch.compile(fullgraph=True, dynamic=False)`` of the layer on a static cache: one graph
    for every step — window wrap-around, OVQ chunk ends and KVM chunk starts (whose static routing
    steps are compiled once too), VQ's absorbs and VLA's refreshes included; recompiling raises."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    x = torch.randn(2, 72, HIDDEN)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        yf, ys, cache, static = _decode_both(layer, x, 21, step=compiled, compile_boundary=True)
    assert_close(ys, yf, STATIC_TOL, name)
    if isinstance(static, StaticOVQCache):
        _dictionaries_agree(cache, static, exact=False)
    elif isinstance(static, StaticKVMCache):
        # the compiled step's memory keys (inductor's LN_s) round differently from the functional
        # path's: the compiled boundary is compared with the eager one on the same ring instead
        eager = _decode_both(layer, x, 21, step=compiled)[3]
        for f in ("state", "value_sums", "radius", "counts"):  # all rows but the spare
            assert torch.equal(getattr(static, f)[:, :, :-1], getattr(eager, f)[:, :, :-1]), f
    elif isinstance(static, StaticVQCache):  # the same codes; the values summed as the compiled step made them
        assert torch.equal(static.counts, cache.counts)
        assert_close(static.value_sums, cache.value_sums, STATIC_TOL)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_static_cache_leaves_the_functional_cache_and_continues_twice(name):
    """A static cache is made from a copy of the functional cache's tensors: its in-place steps and chunk
    boundaries (an absorb at 32) leave the functional cache as it was, and a second static cache made from it
    decodes the same outputs."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    x = torch.randn(2, 40, HIDDEN)
    with torch.no_grad():
        _, cache = layer(x[:, :20], use_cache=True)
        before = [t.clone() for t in cache.tensors()]
        outs = []
        for _ in range(2):
            static, ys = layer.static_cache(cache, 40), []
            for t in range(20, 40):
                ys.append(layer(x[:, t:t + 1], cache=static)[0])
                layer.static_boundary(static, t + 1)
            outs.append(torch.cat(ys, 1))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors()))
    assert torch.equal(outs[0], outs[1])


def test_bad_static_arguments_are_refused():
    torch.manual_seed(0)
    x = torch.randn(1, 20, HIDDEN)
    swa, ovq = LAYERS["swa-7-conv"](), LAYERS["ovq-plateau"]()
    with torch.no_grad():
        _, cache = swa(x, use_cache=True)
        with pytest.raises(ValueError, match=r"capacity=20 must exceed the cache's position 20 \(room for at least one "
                                             r"more token\)"):
            swa.static_cache(cache, 20)
        with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
            swa.static_cache(cache, 0)
        static = swa.static_cache(cache, 30)
        with pytest.raises(ValueError, match=r"one token per call: x must be \[B, 1, hidden\]"):
            swa(x[:, :2], cache=static)
        with pytest.raises(TypeError, match="cache for OVQAttention must be a OVQCache"):
            ovq(x[:, :1], cache=static)
        with pytest.raises(TypeError, match="cache for OVQAttention"):
            ovq.static_cache(cache, 30)
        with pytest.raises(ValueError, match="cache must be a prefill's cache"):
            swa.static_cache(None, 30)
        ovq_cache = ovq(x, use_cache=True)[1]
        ovq.max_centroids = 48  # a cap other than the cache's, for the static cache and for its steps
        cap = r"max_centroids=48 differs from the cache's 24; start a new cache \(prefill\) to change it"
        with pytest.raises(ValueError, match=cap):
            ovq.static_cache(ovq_cache, 30)
        ovq.max_centroids = 24
        ovq_static = ovq.static_cache(ovq_cache, 30)
        with pytest.raises(ValueError, match=cap):
            ovq(x[:, :1], cache=ovq_static, max_centroids=48)
        rnd = ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=16, max_centroids=24, seeding="random")
        with pytest.raises(ValueError, match="seeding='random'"):
            rnd.static_cache(rnd(x, use_cache=True)[1], 30)
        no_static = _NoStatic(HIDDEN, HEADS, window=7, backend="dense")
        with pytest.raises(NotImplementedError, match="_NoStatic has no static"):
            no_static.static_cache(no_static(x, use_cache=True)[1], 30)


def test_static_slots_size_a_plain_cache_by_its_regions():
    """A plain static cache's ``(n_sinks, ring)`` (``static_slots``): the sinks keep their own slots and
    the rest is a ring as long as the most non-sink tokens one query sees (a token window ``w``: ``w``;
    a block window of ``Nb`` chunks of ``C``: ``Nb * C``), or ``capacity`` slots where nothing bounds
    it (full causal attention, sinks included); a region it has no layout for is refused by name."""
    capacity = 100
    assert static_slots((Causal(),), capacity) == (0, capacity)
    assert static_slots((Sinks(3), Causal()), capacity) == (0, capacity)
    assert static_slots((TokenWindow(7),), capacity) == (0, 7)
    assert static_slots((Sinks(2), TokenWindow(5)), capacity) == (2, 5)
    assert static_slots((BlockWindow(3, 16),), capacity) == (0, 48)
    bank = StateBank(rows_per_chunk=4, chunk_size=16, live=torch.tensor([4]))
    with pytest.raises(ValueError, match="regions: no static cache layout for StateBank"):
        static_slots((Causal(), bank), capacity)


class _NoStatic(ovqflex.SlidingWindowAttention):
    """A layer with a functional cache and no static one (as a plugged-in method may be)."""

    static_cache_type = None
