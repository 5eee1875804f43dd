"""The read form of a compressed state kept in a functional cache (``StateView``, docs/design.md §6):
a pure memo. Decoding from a cache with its view equals decoding from the same cache without it, bit
for bit; the view is derived once per chunk; a view that read parameters is derived anew after they
change, and none is kept when it carries an autograd graph."""
import dataclasses

import pytest
import torch

import ovqflex
import ovqflex.ops.kvm_decode as kvm_decode
import ovqflex.ops.ovq_decode as ovq_decode
from ovqflex.cache.base import tensor_key
from tests.helpers import perturbed

HIDDEN, HEADS, C = 32, 2, 16

LAYERS = {
    "ovq": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=C, max_centroids=24, backend="dense"),
    "ovq-normalized": lambda: ovqflex.OVQAttention(HIDDEN, HEADS, chunk_size=C, max_centroids=24,
                                                   normalize_centroids=True, backend="dense"),
    "kvm-powerlaw": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=C, budget="power_law", growth_factor=4.0,
                                                 max_state_chunks=None, backend="dense"),
    "kvm-no-vlens": lambda: ovqflex.KVMAttention(HIDDEN, HEADS, chunk_size=C, use_vlens=False, backend="dense"),
}


def _layer(name):
    torch.manual_seed(0)
    return perturbed(LAYERS[name]()).eval()  # off the init, so LN_s and the temperatures matter


def _decoded(layer, x, t0: int):
    """Prefill ``x[:, :t0]``, then decode one token at a time up to ``x``'s end: the caches after each."""
    _, cache = layer(x[:, :t0], use_cache=True)
    caches = [cache]
    for i in range(t0, x.shape[1]):
        caches.append(layer(x[:, i:i + 1], cache=caches[-1])[1])
    return caches


def _assert_same_step(layer, cache, x1):
    """One step from ``cache`` equals the step from the same cache without its view, bit for bit."""
    y, new = layer(x1, cache=cache)
    y0, new0 = layer(x1, cache=dataclasses.replace(cache, view=None))
    assert torch.equal(y, y0)
    assert [f.name for f in dataclasses.fields(new)] == [f.name for f in dataclasses.fields(new0)]
    for a, b in zip(new.tensors(), new0.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_cached_view_decodes_like_a_derived_one(name):
    layer = _layer(name)
    x = torch.randn(1, 3 * C + 12, HIDDEN)
    with torch.no_grad():
        caches = _decoded(layer, x, 2 * C + 3)
        with_view = [c for c in caches if c.view is not None]
        assert len(with_view) >= C // 2, "the decode steps kept no view"
        view_tensors = [t for t in with_view[0].view if isinstance(t, torch.Tensor)]
        assert {id(t) for t in view_tensors} <= {id(t) for t in with_view[0].tensors()}  # a view's bytes count
        assert with_view[0].nbytes() == dataclasses.replace(with_view[0], view=None).nbytes() + \
            sum(t.numel() * t.element_size() for t in view_tensors)
        for i, cache in enumerate(caches[:-1]):
            _assert_same_step(layer, cache, x[:, 2 * C + 3 + i:2 * C + 4 + i])


@pytest.mark.parametrize("name, derive", [("ovq", (ovq_decode, "_dictionary")),
                                          ("kvm-powerlaw", (kvm_decode, "_state_rows"))], ids=["ovq", "kvm"])
def test_the_view_is_derived_once_per_chunk(name, derive, monkeypatch):
    module, fn = derive
    calls = []
    original = getattr(module, fn)
    monkeypatch.setattr(module, fn, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    layer = _layer(name)
    x = torch.randn(1, 5 * C, HIDDEN)
    with torch.no_grad():
        _decoded(layer, x, 2 * C)  # 3 chunks decoded token by token
    assert len(calls) == 3


def test_a_parameter_s_key_changes_with_its_storage_its_writes_and_its_dtype():
    """``tensor_key``, what tells a view that a parameter it read changed: another tensor in its place (an
    assignment, ``load_state_dict(assign=True)``) even at the same version, an in-place write, the same bytes
    read as another dtype (one storage, one version counter); an inference tensor, which keeps no version
    counter, is never the same twice."""
    a, b = torch.zeros(4), torch.zeros(4)
    assert a._version == b._version and tensor_key(a) != tensor_key(b)
    assert tensor_key(a) == tensor_key(a)
    before = tensor_key(a)
    a.add_(1)
    assert tensor_key(a) != before
    as_int = a.view(torch.int32)
    assert (as_int.data_ptr(), as_int._version) == (a.data_ptr(), a._version) and tensor_key(as_int) != tensor_key(a)
    with torch.inference_mode():
        frozen = torch.zeros(4)
    assert tensor_key(frozen) != tensor_key(frozen) and tensor_key(None) is None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("change", ["ln_s.weight", "ln_s.bias", "tau_state", "load_state_dict"])
def test_a_kvm_view_is_derived_anew_after_its_parameters_change(change, mode):
    """The view reads LN_s and tau_state: written in place (an optimizer step, load_state_dict),
    the next step must not read the stale view. A layer made under ``torch.inference_mode()`` has
    inference-tensor parameters, which keep no version counter: a change to them is seen all the same."""
    with getattr(torch, mode)():
        layer = _layer("kvm-powerlaw")
        assert layer.ln_s.weight.is_inference() == (mode == "inference_mode")
        x = torch.randn(1, 3 * C, HIDDEN)
        cache = _decoded(layer, x[:, :2 * C + 6], 2 * C + 2)[-1]
        assert cache.view is not None
        x1 = x[:, 2 * C + 6:2 * C + 7]
        y_before, _ = layer(x1, cache=cache)
        if change == "load_state_dict":
            layer.load_state_dict({k: v + 0.05 for k, v in layer.state_dict().items()})
        else:
            layer.get_parameter(change).mul_(1.5)
        _assert_same_step(layer, cache, x1)
        assert not torch.equal(layer(x1, cache=cache)[0], y_before)


def test_an_ovq_view_follows_the_normalize_option():
    layer = _layer("ovq")
    x = torch.randn(1, 3 * C, HIDDEN)
    with torch.no_grad():
        cache = _decoded(layer, x[:, :2 * C + 6], 2 * C + 2)[-1]
        assert cache.view is not None
        layer.normalize_centroids = True
        _assert_same_step(layer, cache, x[:, 2 * C + 6:2 * C + 7])


@pytest.mark.parametrize("boundary", [2, 5], ids=["initial-state", "routed-chunk"])
def test_a_kvm_decode_with_gradients_keeps_no_view(boundary):
    """With gradients on, the view reads LN_s with its graph: the new cache keeps none (caches hold
    no graph), and the step's output still reaches the parameters; two tokens that cross the start
    of query chunk ``boundary`` (chunk 2: the initial state is founded; chunk 5: a chunk is routed,
    with the parameters of ``LN_s`` requiring grad) equal the no-grad step."""
    layer = _layer("kvm-powerlaw")
    t = boundary * C
    x = torch.randn(1, t + 2, HIDDEN)
    with torch.no_grad():
        cache = _decoded(layer, x[:, :t - 1], t - 2)[-1]
        expected, _ = layer(x[:, t - 1:], cache=cache)
    y, new = layer(x[:, t - 1:], cache=cache)
    assert torch.equal(y.detach(), expected)
    assert new.view is None and all(not t.requires_grad for t in new.tensors())
    y.sum().backward()
    assert layer.ln_s.weight.grad is not None and layer.ln_s.weight.grad.abs().sum() > 0
