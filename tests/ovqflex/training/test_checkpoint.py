"""Checkpoints: exact round trip, atomic writes, clear errors on truncated, corrupted or edited files."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import ovqflex.training.checkpoint as ck
from ovqflex.training.checkpoint import (FAULT_ENV, CheckpointError, latest_checkpoint, list_checkpoints,
                                         load_checkpoint, load_tensors, remove_leftovers, save_checkpoint)


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
    ("truncate", "model.safetensors is truncated or changed"),
    ("flip", "model.safetensors is corrupted or was edited: SHA-256 does not match manifest.json"),
    ("state-cut", "state.json is truncated or changed"),
    ("state-edit", "state.json is corrupted or was edited: SHA-256 does not match manifest.json"),
    ("missing", "model.safetensors is missing"), ("no-state", "state.json is missing"),
    ("no-manifest", "has no manifest.json: incomplete or not a checkpoint"),
    ("manifest", "manifest.json is corrupted: not valid JSON"),
    ("format-1", "has no manifest.json: written by an older ovqflex \\(checkpoint format 1")], ids=str)
def test_damaged_checkpoint_is_refused(tmp_path, damage, match):
    model, opt = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {"model_config": {"n_heads": 2}})
    weights, state, manifest = path / "model.safetensors", path / "state.json", path / "manifest.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0xFF
        weights.write_bytes(bytes(raw))
    elif damage == "state-cut":
        state.write_text(state.read_text()[:40])
    elif damage == "state-edit":  # same length, still valid JSON: only the checksum sees it
        state.write_text(state.read_text().replace('"n_heads": 2', '"n_heads": 9'))
    elif damage == "missing":
        weights.unlink()
    elif damage == "no-state":
        state.unlink()
    elif damage == "no-manifest":
        manifest.unlink()
    elif damage == "manifest":
        manifest.write_text(manifest.read_text()[:-5])
    else:  # a checkpoint as format 1 wrote it: hashes inside state.json, no manifest
        manifest.unlink()
        state.write_text(state.read_text().replace('"version": 2', '"version": 1'))
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


def test_state_is_json_and_the_manifest_covers_every_file(tmp_path):
    model, opt = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 5, model, opt, {"train_config": {"steps": 10}})
    doc = json.loads((path / "state.json").read_text())
    assert doc["format"] == "ovqflex-checkpoint" and doc["step"] == 5 and doc["train_config"] == {"steps": 10}
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert set(files) == {"model.safetensors", "optimizer.safetensors", "state.json"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] == (path / n).stat().st_size for n, f in files.items())


@pytest.mark.parametrize("fault", ["kill=2", "pause=2"])
def test_killed_between_write_and_rename_leaves_the_last_good_checkpoint(tmp_path, fault):
    """The test hook: a writer killed after writing checkpoint 2 and before renaming it (by
    itself, or from outside while it pauses there) leaves checkpoint 1 the newest; its leftover
    temp directory is not a checkpoint and is removed by the next writer."""
    script = (
        "import sys, torch\n"
        "from ovqflex.training.checkpoint import save_checkpoint\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=1.0)\n"
        "for step in (1, 2):\n"
        "    save_checkpoint(sys.argv[1], step, m, o, {})\n"
        "    print('saved', step, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, FAULT_ENV: fault})
    if fault.startswith("pause"):  # every checkpoint pauses 2 s: kill while number 2 does
        assert proc.stdout.readline() == "saved 1\n"
        while not list((tmp_path / "checkpoints").glob(".tmp-step_00000002-*")):
            assert proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    load_checkpoint(latest_checkpoint(tmp_path))
    leftovers = remove_leftovers(tmp_path)
    assert [p.name.split("-")[1] for p in leftovers] == ["step_00000002"]
    assert not list((tmp_path / "checkpoints").glob(".*"))


def test_load_tensors_names_the_file_and_the_misfits():
    model = torch.nn.Linear(4, 3)
    bad = {"weight": torch.zeros(3, 5), "extra": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="checkpoint file f.safetensors does not fit the model: bias: missing; "
                                              "extra: not in the model; weight: shape \\[3, 5\\], the model has "
                                              "\\[3, 4\\]"):
        load_tensors(model, bad, "f.safetensors")
