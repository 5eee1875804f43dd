"""ovqflex.devices: one meaning of a device name (``auto`` by default) for every entry point."""
import pytest
import torch

from ovqflex.devices import AUTO, failure_line, resolve_device, to_device


def test_auto_is_cuda_if_available_else_cpu():
    assert resolve_device().type == resolve_device(AUTO).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_and_a_bare_cuda_name_the_local_ranks_gpu_where_cuda_is_available(monkeypatch):
    """Where CUDA is available (here pretended: nothing runs on it), ``auto`` and ``cuda`` mean the GPU of the
    process's local rank, and ``cuda:N`` that one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device() == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(AUTO, local_rank=3) == resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", local_rank=3) == torch.device("cuda", 1)
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")


@pytest.mark.parametrize("name, match", [("gpu", "device must be auto .* got 'gpu'"),
                                         (None, "device must be auto .* got None")])
def test_a_bad_device_name_is_refused_by_name(name, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="device 'cuda' requested but CUDA is not available"):
        resolve_device("cuda")


def test_to_device_on_the_cpu_is_to():
    """On the CPU a batch stays what it is (no pinning: that needs an accelerator); the values and
    dtypes are the batch's."""
    x, y = torch.arange(12).view(3, 4), torch.rand(3, 4)
    gx, gy = to_device(torch.device("cpu"), x, y)
    assert gx is x and gy is y and to_device(torch.device("cpu")) == ()


def _dynamo_error() -> Exception:
    """What torch.compile raises for an error inside traced code (here a NotImplementedError with no message)."""
    def f(x):
        raise NotImplementedError
    try:
        torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    except Exception as e:  # (the type dynamo wraps it in varies with the torch version)
        return e
    raise AssertionError("torch.compile ran a function that raises")


def test_failure_line_takes_what_the_message_says_not_torchs_advice():
    e = _dynamo_error()
    assert "TORCHDYNAMO_VERBOSE" in str(e)  # the boilerplate this exists for is really there
    line = failure_line(e)
    assert "TORCHDYNAMO_VERBOSE" not in line and "\n" not in line and line.startswith(type(e).__name__)
    assert failure_line(RuntimeError("\n  lowering failed: no valid choices\n  target: flex_attention\n\n"
                                     "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")) == \
        "RuntimeError: lowering failed: no valid choices"


@pytest.mark.parametrize("error, width, want", [
    (ValueError(), 120, "ValueError"),
    (RuntimeError("x" * 50), 20, "RuntimeError: xxx..."),
    (RuntimeError("x" * 6), 20, "RuntimeError: xxxxxx"),  # exactly the width: whole
    (KeyError("q"), 120, "KeyError: 'q'"),
    (RuntimeError('\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n\nfrom user code:\n  File "m.py", line 3'),
     120, "RuntimeError"),
], ids=["empty", "cut", "at-the-width", "key", "advice-alone"])
def test_failure_line_is_one_bounded_line(error, width, want):
    assert failure_line(error, width) == want and len(want) <= width
