"""The conformance checks every registered method passes (docs/design.md §9), on its layer.

Each check takes a :class:`ovqflex.methods.Method` and builds its layer from ``test_options`` (small,
an eager CPU backend) on one shared shape: x ``[B=2, T=100, 32]``, 2 heads of 16 — with 16-token
chunks the last chunk is ragged. ``tests/ovqflex/test_conformance.py`` runs them over
:data:`ovqflex.methods.METHODS`; a method registered elsewhere (``test_methods.py``) runs them on itself.
"""
import pytest
import torch

import ovqflex
from ovqflex.methods import Method
from tests.helpers import FWD_TOL, assert_close, perturbed

B, T, HIDDEN, HEADS = 2, 100, 32, 2
TOL = FWD_TOL[torch.float32]


def layer_of(method: Method) -> torch.nn.Module:
    """The method's small layer, seeded, moved off its init (unit norms, temperatures 1) so every
    parameter matters."""
    torch.manual_seed(0)
    return perturbed(method.build(HIDDEN, HEADS, **method.test_options))


def inputs(seed: int = 2) -> torch.Tensor:
    """x ``[B, T, HIDDEN]``."""
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed))


def check_causal(method: Method) -> None:
    """In training mode, output ``i`` has zero gradient from every input after ``i`` and a nonzero
    one from some input up to ``i`` (a random weighting: a plain sum can vanish through a norm)."""
    layer = layer_of(method).train()
    x = inputs().requires_grad_()
    y = layer(x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    for i in (0, 15, 16, 47, 64, T - 1):
        (g,) = torch.autograd.grad((y[:, i] * w[:, i]).sum(), x, retain_graph=True)
        assert g[:, i + 1:].abs().sum() == 0, f"{method.name}: output {i} depends on the future"
        assert g[:, : i + 1].abs().sum() > 0, f"{method.name}: output {i} depends on no input"


def check_prefix(method: Method) -> None:
    """The outputs of a prefix (ragged: 70 tokens) are the first outputs of the whole sequence."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert_close(layer(x[:, :70]), layer(x)[:, :70], TOL, f"{method.name} prefix")


def check_batch(method: Method) -> None:
    """A sequence's outputs do not depend on the other sequences of its batch."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert_close(layer(x[1:]), layer(x)[1:], TOL, f"{method.name} batch independence")


def check_deterministic(method: Method) -> None:
    """Two forwards of one input are bit-identical."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x)), f"{method.name}: not deterministic"


def check_decode(method: Method) -> None:
    """A method that decodes: prefill 37 tokens, then decode 1, 5, 16, 1, ... tokens per call through
    the cache == the full forward."""
    if not method.decodes:
        return
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        full = layer(x)
        y, cache = layer(x[:, :37], use_cache=True)
        ys, i, steps = [y], 37, (1, 5, 16)
        while i < T:
            n = min(steps[len(ys) % len(steps)], T - i)
            y, cache = layer(x[:, i:i + n], cache=cache)
            ys.append(y)
            i += n
    assert cache.position == T
    assert_close(torch.cat(ys, dim=1), full, TOL, f"{method.name} prefill + decode")


def check_static_decode(method: Method) -> None:
    """A layer with a static cache: prefill 37 tokens, then decode the rest one token per call through
    ``layer.static_cache(cache, T)`` (written in place, the host calling ``static_boundary`` after
    each step) == the full forward."""
    if not method.decodes or method.layer.static_cache_type is None:
        return
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        full = layer(x)
        y, cache = layer(x[:, :37], use_cache=True)
        static, ys = layer.static_cache(cache, T), [y]
        for i in range(37, T):
            y, same = layer(x[:, i:i + 1], cache=static)
            assert same is static, f"{method.name}: a static step returned another cache"
            ys.append(y)
            layer.static_boundary(static, i + 1)
    assert int(static.position) == T
    assert_close(torch.cat(ys, dim=1), full, TOL, f"{method.name} prefill + static decode")


def check_contract(method: Method) -> None:
    """The layer contract (``ovqflex/layers/base.py``): the return type depends on the arguments only —
    ``layer(x)`` is y, ``return_aux=True`` adds a dict, a prefill or decode step adds a cache of the
    layer's ``cache_type`` (a decode of no tokens: empty y, a copy of the cache); a cache request
    of a layer without one, ``return_aux`` on a cached call and an unknown call option are refused
    by name."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        y = layer(x)
        y2, aux = layer(x, return_aux=True)
        assert isinstance(y, torch.Tensor) and y.shape == x.shape and isinstance(aux, dict)
        assert torch.equal(y, y2), f"{method.name}: return_aux changed y"
        with pytest.raises(TypeError, match=r"unknown option\(s\) \['no_such_option'\]"):
            layer(x, no_such_option=1)
        if not method.decodes:
            with pytest.raises(NotImplementedError, match="has no decode cache"):
                layer(x, use_cache=True)
            return
        y, cache = layer(x[:, :37], use_cache=True)
        assert isinstance(y, torch.Tensor) and type(cache) is layer.cache_type
        with pytest.raises(ValueError, match="return_aux is for full"):
            layer(x[:, 37:38], cache=cache, return_aux=True)
        empty, same = layer(x[:, :0], cache=cache)
        assert empty.shape == (B, 0, HIDDEN) and same is not cache and same.position == 37, method.name
        y1, _ = layer(x[:, 37:40], cache=same)
        y2, _ = layer(x[:, 37:40], cache=cache)
    assert torch.equal(y1, y2), f"{method.name}: an empty decode step changed the cache"


def drawn_output(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """y ``[B, T, hidden]`` of the program ``layer.program(x)`` draws (``ovqflex viz``, the query inspector):
    attended on the layer's backend, then through the layer's output hook (compare: ``layer(x)``)."""
    return layer._output(ovqflex.attend(layer.program(x), layer.backend), layer._project(x, None, False))


def check_program(method: Method) -> None:
    """A drawable method: the program ``layer.program(x)`` draws is the one the layer attends with:
    attended and projected out, it is the layer's forward (eval mode, the layer off its init: a local bias,
    temperatures and norms that the program must carry)."""
    if not method.drawable:
        return
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert_close(drawn_output(layer, x), layer(x), TOL, f"{method.name}: the drawn program")


def check_finite_input(method: Method) -> None:
    """Within ``ovqflex.finite_checks()`` a non-finite x is refused by name, in a full forward and in a
    decode step (whose cache stays usable); outside, the layer runs on it."""
    layer, x = layer_of(method).eval(), inputs()
    bad = x.clone()
    bad[1, 60, 3] = float("inf")
    refused = r"^x must be finite, got 1 non-finite value\(s\) \(nan or inf\) in shape \(2, 100, 32\), " \
              r"the first at index \[1, 60, 3\]$"
    with torch.no_grad():
        layer(bad)
        unchecked = layer(x)
        with ovqflex.finite_checks():
            assert torch.equal(layer(x), unchecked), f"{method.name}: the check changed y"
            with pytest.raises(ValueError, match=refused):
                layer(bad)
            if not method.decodes:
                return
            y, cache = layer(x[:, :37], use_cache=True)
            with pytest.raises(ValueError, match=r"^x must be finite, got 1 non-finite value\(s\)"):
                layer(bad[:, 60:61], cache=cache)
            step, _ = layer(x[:, 37:38], cache=cache)
        full = layer(x[:, :38])[:, 37:]
    assert_close(step, full, TOL, f"{method.name} decode after a refused step")


def float_options(method: Method) -> list[str]:
    """The method's options whose default is a float (a layer keyword or a field of its options dataclass)."""
    import dataclasses
    import inspect

    names = [p.name for p in inspect.signature(method.layer).parameters.values()
             if p.kind == p.KEYWORD_ONLY and isinstance(p.default, float)]
    if method.options is not None:
        names += [f.name for f in dataclasses.fields(method.options) if isinstance(f.default, float)]
    return sorted(set(names) - set(method.fixed))


def check_finite_options(method: Method) -> None:
    """Each float option refuses NaN and infinities by name when the layer is built (``rope_base=inf``
    had turned RoPE off, ``norm_eps=inf`` zeroed a norm's output, ``nan`` made NaN outputs)."""
    for name in float_options(method):
        for value in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match=f"^{name} must be a finite number"):
                method.build(HIDDEN, HEADS, **{**method.test_options, name: value})


CHECKS = {"causal": check_causal, "prefix": check_prefix, "batch": check_batch, "deterministic": check_deterministic,
          "decode": check_decode, "static_decode": check_static_decode, "contract": check_contract,
          "program": check_program, "finite_input": check_finite_input, "finite_options": check_finite_options}
