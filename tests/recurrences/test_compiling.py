"""recurrences/compiling.py: fixed-shape compiled code survives more input shapes than dynamo's
default recompile limit (8), where ``fullgraph=True`` would raise ``FailOnRecompileLimitHit``."""
import torch

from recurrences.compiling import RECOMPILE_LIMIT, compile_fixed_shapes
from recurrences.kvm import routing_static as kvm_static
from recurrences.ovq import routing_static as ovq_static


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
