"""The conformance checks every registered method passes (docs/design.md §9), on its layer.

Each check takes a :class:`ovqflex.methods.Method` and builds its layer from ``test_options`` (small,
an eager CPU backend) on one shared shape: x ``[B=2, T=100, 32]``, 2 heads of 16 — with 16-token
chunks the last chunk is ragged. ``tests/ovqflex/test_conformance.py`` runs them over
:data:`ovqflex.methods.METHODS`; a method registered elsewhere (``test_methods.py``) runs them on itself.
"""
import torch

from ovqflex.methods import Method
from tests.helpers import FWD_TOL, assert_close

B, T, HIDDEN, HEADS = 2, 100, 32, 2
TOL = FWD_TOL[torch.float32]


def layer_of(method: Method) -> torch.nn.Module:
    """The method's small layer, seeded, moved off its init (unit norms, temperatures 1) so every
    parameter matters."""
    torch.manual_seed(0)
    layer = method.build(HIDDEN, HEADS, **method.test_options)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return layer


def inputs(seed: int = 2) -> torch.Tensor:
    """x ``[B, T, HIDDEN]``."""
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed))


def output(layer, x: torch.Tensor) -> torch.Tensor:
    """y ``[B, T, HIDDEN]`` of a full forward (the layers with an aux loss return ``(y, aux)``)."""
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def check_causal(method: Method) -> None:
    """In training mode, output ``i`` has zero gradient from every input after ``i`` and a nonzero
    one from some input up to ``i`` (a random weighting: a plain sum can vanish through a norm)."""
    layer = layer_of(method).train()
    x = inputs().requires_grad_()
    y = output(layer, x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    for i in (0, 15, 16, 47, 64, T - 1):
        (g,) = torch.autograd.grad((y[:, i] * w[:, i]).sum(), x, retain_graph=True)
        assert g[:, i + 1:].abs().sum() == 0, f"{method.name}: output {i} depends on the future"
        assert g[:, : i + 1].abs().sum() > 0, f"{method.name}: output {i} depends on no input"


def check_prefix(method: Method) -> None:
    """The outputs of a prefix (ragged: 70 tokens) are the first outputs of the whole sequence."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert_close(output(layer, x[:, :70]), output(layer, x)[:, :70], TOL, f"{method.name} prefix")


def check_batch(method: Method) -> None:
    """A sequence's outputs do not depend on the other sequences of its batch."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert_close(output(layer, x[1:]), output(layer, x)[1:], TOL, f"{method.name} batch independence")


def check_deterministic(method: Method) -> None:
    """Two forwards of one input are bit-identical."""
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        assert torch.equal(output(layer, x), output(layer, x)), f"{method.name}: not deterministic"


def check_decode(method: Method) -> None:
    """A method that decodes: prefill 37 tokens, then decode 1, 5, 16, 1, ... tokens per call through
    the cache == the full forward."""
    if not method.decodes:
        return
    layer, x = layer_of(method).eval(), inputs()
    with torch.no_grad():
        full = output(layer, x)
        y, cache = layer(x[:, :37], use_cache=True)
        ys, i, steps = [y], 37, (1, 5, 16)
        while i < T:
            n = min(steps[len(ys) % len(steps)], T - i)
            y, cache = layer(x[:, i:i + n], cache=cache)
            ys.append(y)
            i += n
    assert cache.position == T
    assert_close(torch.cat(ys, dim=1), full, TOL, f"{method.name} prefill + decode")


CHECKS = {"causal": check_causal, "prefix": check_prefix, "batch": check_batch, "deterministic": check_deterministic,
          "decode": check_decode}
