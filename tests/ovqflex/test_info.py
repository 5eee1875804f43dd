"""ovqflex/info.py: the rows ``ovqflex info`` prints."""
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
