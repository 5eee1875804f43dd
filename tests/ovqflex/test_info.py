"""ovqflex/info.py: the rows ``ovqflex info`` prints."""
import platform
import re

import torch

from ovqflex import info


def test_info_names_the_default_routing_of_the_device(monkeypatch):
    monkeypatch.setattr(info, "_probe", lambda backend, device, backward: "yes")  # no compile here
    rows = dict(info.collect("cpu"))
    assert rows["routing auto (OVQ, KVM)"] == "loop: one step per chunk"
    assert rows["auto (training)"] == "blocked" and rows["flex forward"] == "yes"
    monkeypatch.setattr(info, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    assert dict(info.collect("cuda"))["routing auto (OVQ, KVM)"].startswith("static: compiled step, one CUDA graph")


def test_a_backend_that_fails_with_no_message_is_reported_not_raised(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError()
    monkeypatch.setattr(info, "sliding_window_attention", broken)
    assert info._probe("flex", torch.device("cpu"), backward=False) == "no (RuntimeError)"


class _ForwardOnly(torch.autograd.Function):
    """A backend as CPU flex is in torch 2.13: a forward, no backward."""

    @staticmethod
    def forward(ctx, q):
        return 2 * q

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("no backward here")


def test_a_forward_only_backend_is_yes_forward_and_not_implemented_backward(monkeypatch):
    """The probe runs the op with gradients on and its backward for the backward row; flex's rows say how
    long the call took (its compile), the others yes or no."""
    calls = []

    def forward_only(q, k, v, *, window, backend):
        calls.append((backend, q.requires_grad, torch.is_grad_enabled()))
        return _ForwardOnly.apply(q)

    monkeypatch.setattr(info, "sliding_window_attention", forward_only)
    cpu = torch.device("cpu")
    assert re.fullmatch(r"yes \(\d+\.\d\d s incl\. compile\)", info._probe("flex", cpu, backward=False))
    assert info._probe("blocked", cpu, backward=False) == "yes"
    assert info._probe("blocked", cpu, backward=True) == "no (not implemented here)"
    assert calls == [("flex", False, False), ("blocked", False, False), ("blocked", True, True)]


def test_info_names_the_cpu_and_its_threads(monkeypatch):
    monkeypatch.setattr(info, "_probe", lambda backend, device, backward: "yes")
    assert dict(info.collect("cpu"))["device"] == f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def test_each_backend_is_probed_forward_and_backward_and_auto_names_the_devices_training_backend(monkeypatch):
    monkeypatch.setattr(info, "_probe", lambda backend, device, backward: f"{backend} {device} {backward}")
    monkeypatch.setattr(info, "training_backend", lambda device: f"trains on {device}")
    rows = dict(info.collect("cpu"))
    for backend in ("flex", "blocked", "dense"):
        assert (rows[f"{backend} forward"], rows[f"{backend} backward"]) == (f"{backend} cpu False",
                                                                             f"{backend} cpu True")
    assert rows["auto (training)"] == "trains on cpu"


def test_the_info_command_reports_on_its_device(monkeypatch, capsys):
    from ovqflex.cli import main

    asked = []
    monkeypatch.setattr(info, "collect", lambda device: asked.append(device) or [("device", f"{device} here")])
    assert main(["info", "--device", "cpu"]) == 0
    assert asked == ["cpu"] and "cpu here" in capsys.readouterr().out
