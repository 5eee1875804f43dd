"""Checkpoints: exact round trip, atomic writes, clear errors on truncated, corrupted or edited files."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ovqflex.training.checkpoint as ck
from ovqflex.training.checkpoint import (FAULT_ENV, CheckpointError, latest_checkpoint, list_checkpoints,
                                         load_checkpoint, load_optimizer, load_tensors, remove_leftovers,
                                         run_checkpoint, save_checkpoint)


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


@pytest.mark.parametrize("keep, kept", [(2, (3, 4)), (1, (4,)), (0, (1, 2, 3, 4))],
                         ids=["keep-2", "keep-1", "keep-all"])
def test_keeps_the_newest(tmp_path, keep, kept):
    """``keep`` newest checkpoints are kept (0: all of them)."""
    model, opt = _model_and_optimizer()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, {}, keep=keep)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{s:08d}" for s in kept]
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    assert not list((tmp_path / "checkpoints").glob(".*"))  # the pruned ones are gone, not left aside


def test_a_crash_while_replacing_a_step_never_leaves_half_of_it(tmp_path, monkeypatch):
    """Re-saving a step (a run resumed from an older checkpoint) moves the old one aside before removing
    it: a crash half-way through the removal leaves a dot-named leftover, never half a ``step_*``."""
    model, opt = _model_and_optimizer()
    save_checkpoint(tmp_path, 1, model, opt, {})
    save_checkpoint(tmp_path, 2, model, opt, {})
    real = ck.shutil.rmtree

    def dying_rmtree(path, *args, **kwargs):  # removes one file, then the process "dies"
        next(p for p in sorted(ck.Path(path).iterdir()) if p.is_file()).unlink()
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ck.shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, {})
    monkeypatch.setattr(ck.shutil, "rmtree", real)
    for path in list_checkpoints(tmp_path):
        load_checkpoint(path)  # each complete
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert {p.name.split("-")[1] for p in remove_leftovers(tmp_path)} == {"step_00000002"}


@pytest.mark.parametrize("damage, match", [
    ("truncate", "model.safetensors is truncated or changed"),
    ("flip", "model.safetensors is corrupted or was edited: SHA-256 does not match manifest.json"),
    ("state-cut", "state.json is truncated or changed"),
    ("state-edit", "state.json is corrupted or was edited: SHA-256 does not match manifest.json"),
    ("missing", "model.safetensors is missing"), ("no-state", "state.json is missing"),
    ("no-manifest", "has no manifest.json: incomplete or not a checkpoint"),
    ("no-manifest-list", "has no manifest.json: incomplete or not a checkpoint"),
    ("manifest", "manifest.json is corrupted: not valid JSON"),
    ("manifest-bytes", "manifest.json is corrupted: not valid JSON"),
    ("manifest-version", "manifest.json has format version 1, this ovqflex reads 2"),
    ("manifest-format", "manifest.json is not an ovqflex-checkpoint manifest"),
    ("manifest-no-state", "manifest.json must give bytes and sha256 of model.safetensors, optimizer.safetensors and "
                          "state.json"),
    ("manifest-no-sha", "manifest.json must give bytes and sha256 of"),
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
    elif damage == "no-manifest-list":  # and a state.json that is JSON but not an object
        manifest.unlink()
        state.write_text("[1]")
    elif damage == "manifest":
        manifest.write_text(manifest.read_text()[:-5])
    elif damage == "manifest-bytes":  # not even UTF-8
        manifest.write_bytes(b"\xff\xfe{" + manifest.read_bytes())
    elif damage == "manifest-version":  # the manifest is not checksummed: its own fields are checked
        manifest.write_text(manifest.read_text().replace('"version": 2', '"version": 1'))
    elif damage == "manifest-format":
        manifest.write_text(manifest.read_text().replace('"ovqflex-checkpoint"', '"other"'))
    elif damage.startswith("manifest-no"):  # an entry left out: state.json would go unchecked
        doc = json.loads(manifest.read_text())
        if damage == "manifest-no-state":
            del doc["files"]["state.json"]
        else:
            del doc["files"]["model.safetensors"]["sha256"]
        manifest.write_text(json.dumps(doc))
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


def test_remove_leftovers_removes_what_killed_writers_left_and_nothing_else(tmp_path):
    """A killed writer's leftovers: a checkpoint's temp or discarded directory (dot-named, under
    ``checkpoints/``) and an atomic write's temp file (``.<name>.tmp-<pid>``, in the run directory)."""
    model, opt = _model_and_optimizer()
    good = save_checkpoint(tmp_path, 1, model, opt, {})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / ".config.json.tmp-4242").write_text("{")
    (tmp_path / ".metrics.jsonl.tmp-7").write_text("")
    (tmp_path / "checkpoints" / ".tmp-step_00000002-4242").mkdir()
    (tmp_path / "checkpoints" / ".del-step_00000000-4242").mkdir()
    gone = remove_leftovers(tmp_path)
    assert sorted(p.name for p in gone) == [".config.json.tmp-4242", ".del-step_00000000-4242", ".metrics.jsonl.tmp-7",
                                            ".tmp-step_00000002-4242"]
    assert not any(p.exists() for p in gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.json"]
    assert list_checkpoints(tmp_path) == [good]
    load_checkpoint(good)
    assert remove_leftovers(tmp_path / "never-trained") == []


def test_run_checkpoint_names_one_of_the_runs_checkpoints(tmp_path):
    """``None``: the latest; a name or a path: that checkpoint if it is the run's. Only directories
    named ``step_*`` are checkpoints."""
    model, opt = _model_and_optimizer()
    run, other = tmp_path / "run", tmp_path / "other"
    first, second = (save_checkpoint(run, step, model, opt, {}) for step in (1, 2))
    foreign = save_checkpoint(other, 1, model, opt, {})
    (run / "checkpoints" / "step_00000009").write_text("not a checkpoint")
    assert list_checkpoints(run) == [first, second] and latest_checkpoint(run) == second
    assert run_checkpoint(run) == second
    assert run_checkpoint(run, "step_00000001") == first == run_checkpoint(run, str(first))
    with pytest.raises(CheckpointError, match="is not one of run .*run's checkpoints \\(step_00000001, step_00000002"):
        run_checkpoint(run, foreign)
    with pytest.raises(CheckpointError, match="has no checkpoint 'step_00000009'; its checkpoints: step_00000001, "):
        run_checkpoint(run, "step_00000009")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="run .*empty has no checkpoint 'step_00000001'; its checkpoints: none$"):
        run_checkpoint(tmp_path / "empty", "step_00000001")


def test_a_tensor_file_safetensors_cannot_read_is_refused_by_name(tmp_path):
    """A tensor file whose bytes match the manifest but are not safetensors (written so by a bug, or the
    manifest rewritten to match): safetensors' own error becomes a CheckpointError naming the checkpoint."""
    model, opt = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    weights, manifest = path / "model.safetensors", path / "manifest.json"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    doc = json.loads(manifest.read_text())
    doc["files"]["model.safetensors"] = {"bytes": weights.stat().st_size, "sha256": ck._sha256(weights)}
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} could not be read: "):
        load_checkpoint(path)


def test_load_optimizer_names_the_file_when_the_optimizer_does_not_fit(tmp_path):
    model, opt = _model_and_optimizer()
    ckpt = load_checkpoint(save_checkpoint(tmp_path, 1, model, opt, {}))
    two_groups = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    with pytest.raises(CheckpointError, match="optimizer.safetensors does not fit the optimizer: loaded state dict "
                                              "has a different number of parameter groups"):
        load_optimizer(two_groups, ckpt)


def test_load_tensors_lists_five_misfits_and_counts_the_rest():
    model = torch.nn.Linear(4, 3)
    extra = {f"extra{i}": torch.zeros(1) for i in range(6)}
    with pytest.raises(CheckpointError, match="weight: missing; bias: missing; extra0: not in the model; extra1: not "
                                              "in the model; extra2: not in the model \\(and 3 more\\)$"):
        load_tensors(model, extra, "f.safetensors")


def test_a_bad_fault_injection_setting_is_refused(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    monkeypatch.setenv(FAULT_ENV, "crash=2")
    with pytest.raises(ValueError, match="OVQFLEX_FAULT_CHECKPOINT must be pause=SECONDS or kill=STEP, got 'crash=2'"):
        save_checkpoint(tmp_path, 1, model, opt, {})


def test_every_file_and_directory_is_synced_before_and_after_the_rename(tmp_path, monkeypatch):
    """What makes a checkpoint survive a power cut: its files (the JSON ones as they are written) and its
    directory are synced before the rename that publishes it, and the parent directory after it (so the
    rename itself is on disk)."""
    model, opt = _model_and_optimizer()
    events = []
    real_fsync, real_rename = ck._fsync, ck.os.rename
    monkeypatch.setattr(ck, "_fsync", lambda path: (events.append(("fsync", Path(path).name)), real_fsync(path)))
    monkeypatch.setattr(ck.os, "rename", lambda a, b: (events.append(("rename", Path(b).name)), real_rename(a, b)))
    save_checkpoint(tmp_path, 1, model, opt, {})
    tmp = next(name for kind, name in events if kind == "fsync" and name.startswith(".tmp-step_00000001"))
    assert events == [("fsync", "model.safetensors"), ("fsync", "optimizer.safetensors"), ("fsync", "state.json"),
                      ("fsync", tmp), ("rename", "step_00000001"), ("fsync", "checkpoints")]
