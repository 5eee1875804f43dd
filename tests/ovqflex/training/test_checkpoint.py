"""Checkpoints: exact round trip, atomic writes, clear errors on truncated or corrupted files."""
import json
import random

import pytest
import torch

import ovqflex.training.checkpoint as ck
from ovqflex.training.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint,
                                         save_checkpoint)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_is_exact(tmp_path):
    model, opt = _model_and_optimizer()
    torch.manual_seed(123)
    random.seed(7)
    path = save_checkpoint(tmp_path, 3, model, opt, {"note": "hi"})
    expected_torch, expected_py = torch.rand(3), random.random()
    torch.manual_seed(0)
    random.seed(0)
    ckpt = load_checkpoint(path)
    assert ckpt.step == 3 and ckpt.state["note"] == "hi" and latest_checkpoint(tmp_path) == path
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt.model[k], v)
    model2, opt2 = _model_and_optimizer()
    opt2.load_state_dict(ckpt.optimizer)
    for (i, s1), (j, s2) in zip(opt.state_dict()["state"].items(), opt2.state_dict()["state"].items()):
        assert i == j and all(torch.equal(s1[n], s2[n]) for n in s1)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    ck.set_rng_state(ckpt.state["rng"])
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py


def test_keeps_the_newest(tmp_path):
    model, opt = _model_and_optimizer()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path).name == "step_00000004"


@pytest.mark.parametrize("damage, match", [
    ("truncate", "truncated or changed"), ("flip", "corrupted: SHA-256"), ("state", "not valid JSON"),
    ("missing", "is missing"), ("no-state", "has no state.json")], ids=str)
def test_damaged_checkpoint_is_refused(tmp_path, damage, match):
    model, opt = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0xFF
        weights.write_bytes(bytes(raw))
    elif damage == "state":
        (path / "state.json").write_text((path / "state.json").read_text()[:40])
    elif damage == "missing":
        weights.unlink()
    else:
        (path / "state.json").unlink()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    good = save_checkpoint(tmp_path, 1, model, opt, {})
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    calls = {"n": 0}
    real = ck.save_file

    def dying_save(tensors, filename):
        calls["n"] += 1
        if calls["n"] == 2:  # the optimizer file: the process "dies" half-way through the checkpoint
            raise KeyboardInterrupt("killed")
        real(tensors, filename)

    monkeypatch.setattr(ck, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, {})
    assert latest_checkpoint(tmp_path) == good
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    load_checkpoint(good)
    # the next successful save replaces the leftovers
    monkeypatch.setattr(ck, "save_file", real)
    assert save_checkpoint(tmp_path, 2, model, opt, {}).name == "step_00000002"


def test_latest_pointing_nowhere_is_an_error(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        latest_checkpoint(tmp_path)


def test_state_is_json_with_hashes(tmp_path):
    model, opt = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 5, model, opt, {"train_config": {"steps": 10}})
    doc = json.loads((path / "state.json").read_text())
    assert doc["format"] == "ovqflex-checkpoint" and doc["step"] == 5
    assert set(doc["files"]) == {"model.safetensors", "optimizer.safetensors"}
    assert all(len(f["sha256"]) == 64 for f in doc["files"].values())
