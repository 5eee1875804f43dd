"""ovqflex.devices: one meaning of a device name (``auto`` by default) for every entry point."""
import pytest
import torch

from ovqflex.devices import AUTO, resolve_device, to_device


def test_auto_is_cuda_if_available_else_cpu():
    assert resolve_device().type == resolve_device(AUTO).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


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
